"""Bad input raises ValueError naming the field, and leaves nothing behind."""

from __future__ import annotations

import pytest

from chunkserve import LLM, EngineConfig, SamplingParams
from chunkserve.config import DEFAULT_LONG_STEP_SHARE, BudgetPolicy
from chunkserve.engine.engine import Engine
from tests.conftest import assert_no_blocks_in_use


@pytest.fixture
def engine(shared_engine) -> Engine:
    return shared_engine


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": 2**40}, "min_tokens"),
        ({"stop": ["a"] * 33}, "stop"),
        ({"stop": ["a" * 513]}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-5: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_empty_prompt(engine: Engine) -> None:
    with pytest.raises(ValueError, match="^prompt:"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="^prompt:"):
        engine.add_request([], SamplingParams())
    assert_no_blocks_in_use(engine)


def test_prompt_longer_than_max_model_len(engine: Engine) -> None:
    n = engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(100, 100 + n + 44)), SamplingParams())
    with pytest.raises(
        ValueError, match=f"^max_tokens: .*maximum context length is {n}"
    ):  # prompt + max_tokens too long
        engine.add_request(list(range(100, 100 + n - 56)), SamplingParams(max_tokens=100))
    assert_no_blocks_in_use(engine)


def test_token_ids_outside_vocabulary(engine: Engine) -> None:
    with pytest.raises(ValueError, match="^prompt: token id"):
        engine.add_request([1, 2, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="^stop_token_ids: token id 999999999"):
        engine.add_request("hi", SamplingParams(min_tokens=1, stop_token_ids=[999999999]))
    with pytest.raises(ValueError, match="^logit_bias: token id 49152"):
        engine.add_request("hi", SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match="^priority:"):
        engine.add_request("hi", SamplingParams(), priority=2**63)
    with pytest.raises(ValueError, match="^min_tokens:"):
        engine.add_request("hi", SamplingParams(max_tokens=None, min_tokens=engine.max_model_len))
    assert_no_blocks_in_use(engine)
    assert engine.core.scheduler.num_waiting == 0


def test_duplicate_request_id(engine: Engine) -> None:
    engine.add_request("hello", SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("hello", SamplingParams(max_tokens=2), request_id="dup")
    engine.abort_request("dup")
    assert_no_blocks_in_use(engine)


def test_generate_with_one_bad_prompt_queues_nothing(engine: Engine) -> None:
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_blocks_in_use(engine)
    assert engine.core.scheduler.num_waiting == 0


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="^model: no such file"):
        LLM(model="/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="^model:"):
        LLM(model=__file__)  # exists, not a model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"kv_cache_memory": -1}, "kv_cache_memory"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_engine_config_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_decode_slowdown": 0.5}, "max_decode_slowdown"),
        ({"max_decode_slowdown": 2.0, "itl_slo_ms": 100.0}, "max_decode_slowdown"),
        ({"max_decode_slowdown": 2.0, "enable_chunked_prefill": False}, "max_decode_slowdown"),
        ({"long_step_share": -0.01}, "long_step_share"),
        ({"long_step_share": 0.5}, "long_step_share"),
        ({"long_step_share": "0.01"}, "long_step_share"),
        ({"long_step_share": 0.01, "itl_slo_ms": 100.0}, "long_step_share"),
        ({"long_step_share": 0.01, "enable_chunked_prefill": False}, "long_step_share"),
        ({"prefill_order": "random"}, "prefill_order"),
    ],
)
def test_budget_config_errors(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**kwargs)


def test_budget_policy_from_the_flags() -> None:
    """No budget named: adaptive (cap min(8192, max_model_len)). A budget named alone:
    static, as in vLLM. A target named: that target, the budget its cap. Chunking off:
    static."""
    policy = EngineConfig().budget_policy(4096)
    assert (policy.kind, policy.max_num_batched_tokens) == ("adaptive", 4096)
    assert policy.decode_slowdown == 2.0
    assert EngineConfig().budget_policy(32768).max_num_batched_tokens == 8192
    static = EngineConfig(max_num_batched_tokens=256).budget_policy(4096)
    assert (static.kind, static.max_num_batched_tokens) == ("static", 256)
    assert policy.long_step_share == DEFAULT_LONG_STEP_SHARE
    capped = EngineConfig(max_num_batched_tokens=256, max_decode_slowdown=1.5)
    assert capped.budget_policy(4096) == BudgetPolicy(
        "adaptive", 256, decode_slowdown=1.5, long_step_share=DEFAULT_LONG_STEP_SHARE
    )
    no_long = EngineConfig(max_num_batched_tokens=256, long_step_share=0.0).budget_policy(4096)
    assert no_long == BudgetPolicy("adaptive", 256, decode_slowdown=2.0, long_step_share=0.0)
    with pytest.raises(ValueError, match="^long_step_share:"):
        BudgetPolicy("static", 256, long_step_share=0.01)
    itl = EngineConfig(itl_slo_ms=250).budget_policy(4096)
    assert (itl.kind, itl.max_num_batched_tokens, itl.itl_slo_s) == ("itl-target", 4096, 0.25)
    off = EngineConfig(enable_chunked_prefill=False).budget_policy(4096)
    assert (off.kind, off.max_num_batched_tokens) == ("static", 512)
    assert EngineConfig().scheduler_config(4096).max_num_seqs == 128
    for p in (policy, static, itl):
        assert p.describe().startswith(p.kind + ":")


def test_unknown_engine_option() -> None:
    with pytest.raises(TypeError, match="bogus"):
        EngineConfig.from_kwargs(bogus=1)


def test_kv_cache_too_small_for_max_model_len(no_weight_loading) -> None:
    with pytest.raises(ValueError, match="^kv_cache_memory:"):
        Engine(dtype="float32", max_model_len=4096, kv_cache_memory=1 << 20)


def test_max_num_seqs_above_budget_with_chunking(no_weight_loading) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(
            dtype="float32",
            max_model_len=256,
            kv_cache_memory=16 << 20,
            max_num_batched_tokens=16,
            max_num_seqs=64,
        )


def test_serve_flags_name_the_budget_policy() -> None:
    """``--long-step-share`` and ``--max-decode-slowdown`` reach the adaptive policy; with
    ``--max-num-batched-tokens`` they make it the adaptive budget's cap."""
    from chunkserve.engine_args import engine_config_from_args
    from chunkserve.entrypoints.cli import build_parser

    def policy(*argv: str) -> BudgetPolicy:
        args = build_parser("serve").parse_args(["serve", *argv])
        return engine_config_from_args(args).budget_policy(4096)

    assert policy().long_step_share == DEFAULT_LONG_STEP_SHARE
    assert policy("--long-step-share", "0").long_step_share == 0.0
    capped = policy("--max-num-batched-tokens", "256", "--long-step-share", "0.01")
    assert capped == BudgetPolicy("adaptive", 256, decode_slowdown=2.0, long_step_share=0.01)
    assert policy("--max-num-batched-tokens", "256").kind == "static"


def llm_on(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    return llm


def test_generate_takes_vllm_prompt_dicts(engine: Engine) -> None:
    """vLLM's prompt dicts (``TokensPrompt``, ``TextPrompt``), in a list or alone, give what
    the plain forms give."""
    llm = llm_on(engine)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    ids = engine.tokenizer.encode("The capital of France is")
    plain = llm.generate([ids, "The capital of France is"], greedy, use_tqdm=False)
    forms = [{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}]
    dicts = llm.generate(forms, greedy, use_tqdm=False)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[1].prompt == "The capital of France is"
    (alone,) = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert alone.token_ids == plain[0].token_ids
    (text,) = llm.generate({"prompt": "The capital of France is"}, greedy, use_tqdm=False)
    assert text.token_ids == plain[1].token_ids
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize(
    "prompts",
    [
        [{"prompt_ids": [1, 2]}],
        {"multi_modal_data": {}, "prompt": "x"},
        [{}],
        [3.5],
        [None],
        [{"prompt": 5}],
        [{"prompt_token_ids": "abc"}],
        7,
    ],
    ids=repr,
)
def test_generate_refuses_other_prompts_saying_what_a_prompt_is(engine: Engine, prompts) -> None:
    with pytest.raises(ValueError, match=r"^prompts?(_token_ids)?: .*(token ids|a prompt is)"):
        llm_on(engine).generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_blocks_in_use(engine)
    assert engine.core.scheduler.num_waiting == 0


def test_prompt_with_a_lone_surrogate(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode.*U\+D800, at character 6"):
        engine.add_request("hello \ud800", SamplingParams())
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode"):
        engine.add_request({"prompt": "\udfff"}, SamplingParams())
    assert_no_blocks_in_use(engine)


def count_validations(monkeypatch) -> list[int]:
    calls = [0]
    real = SamplingParams.validate

    def counted(self) -> None:
        calls[0] += 1
        real(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    return calls


def test_offline_generate_validates_sampling_params_once(engine: Engine, monkeypatch) -> None:
    calls = count_validations(monkeypatch)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert calls[0] == 1  # built: it checks itself
    llm_on(engine).generate(["a", "b", "c"], params, use_tqdm=False)
    assert calls[0] == 1  # the edge trusts an unchanged one


def test_sampling_params_changed_after_building_are_checked_at_the_edge(engine: Engine) -> None:
    params = SamplingParams(max_tokens=2)
    params.temperature = -1.0
    with pytest.raises(ValueError, match="^temperature:"):
        engine.add_request("hi", params)
    params.temperature, params.max_tokens = 0.0, 0
    with pytest.raises(ValueError, match="^max_tokens:"):
        engine.add_request("hi", params)
    assert_no_blocks_in_use(engine)
    assert engine.core.scheduler.num_waiting == 0
