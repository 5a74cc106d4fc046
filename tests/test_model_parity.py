"""Our Llama forward against HF transformers on the same weights, in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.engine.engine import Engine
from chunkserve.scheduling.request import Request
from chunkserve.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from tests.conftest import NATURAL_PROMPTS, assert_no_blocks_in_use

KV_MEMORY = 64 << 20


@pytest.fixture
def engine(shared_engine) -> Engine:
    return shared_engine


def all_row_logits(engine: Engine, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Run a prompt through the model in chunks of ``chunk`` tokens (each attending to the
    cached earlier chunks) and return the logits of every row, [len, vocab]."""
    req = Request("parity", token_ids, SamplingParams(max_tokens=1), max_tokens=1)
    rows = []
    try:
        for start in range(0, len(token_ids), chunk):
            n = min(chunk, len(token_ids) - start)
            assert engine.core.kv.allocate_slots(req, n)
            out = SchedulerOutput(prefills=[ScheduledChunk(req, start, n)])
            with torch.inference_mode():
                layout, _ = engine.core.worker.runner.build_layout(out)
                meta = engine.core.worker.runner.prepare(layout)
                hidden = engine.core.worker.model(
                    layout,
                    engine.core.worker.runner.kv_caches,
                    engine.core.worker.runner.attn,
                    meta,
                )
                rows.append(engine.core.worker.model.compute_logits(hidden[:n]))  # no padding
            req.num_computed_tokens += n
    finally:
        engine.core.kv.free(req)
    return torch.cat(rows).cpu()  # the reference runs on the CPU whatever the device


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [10_000, 7, 16])
def test_logits_match_hf(engine: Engine, hf_model, chunk: int) -> None:
    for prompt in NATURAL_PROMPTS[:4]:
        ids = engine.tokenizer.encode(prompt)
        ours = all_row_logits(engine, ids, chunk)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        err = relative_error(ours, ref)
        assert err < 1e-4, f"{prompt!r} chunk={chunk}: relative error {err:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("n,chunk", [(400, 96), (700, 700)])
def test_long_prompt_logits_match_hf(engine: Engine, hf_model, n: int, chunk: int) -> None:
    """Chunked, and one step of more rows than the CPU's MLP slices."""
    text = " ".join(NATURAL_PROMPTS) * 16
    ids = engine.tokenizer.encode(text)[:n]
    assert len(ids) == n
    ours = all_row_logits(engine, ids, chunk)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert relative_error(ours, ref) < 1e-4


def test_32_greedy_tokens_match_hf(engine: Engine, hf_model) -> None:
    prompts = [engine.tokenizer.encode(p) for p in NATURAL_PROMPTS[:4]]
    params = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    # HF's greedy choice after the prompt and each of our tokens, in one forward over the
    # whole sequence (not 32 decode steps): equal at every position exactly when HF's greedy
    # generation makes our 32 tokens. As min_new_tokens does, the EOS tokens are barred.
    eos = sorted(engine.eos_token_ids)
    for rid, prompt in zip(ids, prompts):
        assert len(done[rid]) == 32
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + done[rid]])).logits[0].float()
        logits = logits[len(prompt) - 1 : -1]
        logits[:, eos] = float("-inf")
        assert logits.argmax(-1).tolist() == done[rid]
    assert_no_blocks_in_use(engine)


def test_hf_safetensors_dir_loads_and_matches_gguf(hf_dir: Path, engine: Engine) -> None:
    llm = LLM(model=str(hf_dir), dtype="float32", max_model_len=1024, kv_cache_memory=KV_MEMORY)
    assert llm.engine.model_config.tie_word_embeddings
    assert llm.engine.eos_token_ids == engine.eos_token_ids
    ids = engine.tokenizer.encode(NATURAL_PROMPTS[0])
    assert llm.tokenizer.encode(NATURAL_PROMPTS[0]) == ids
    a = all_row_logits(llm.engine, ids, 4)
    b = all_row_logits(engine, ids, 4)
    assert relative_error(a, b) < 1e-5
    messages = [{"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(messages) == engine.tokenizer.apply_chat_template(
        messages
    )


def test_bf16_close_to_fp32(engine: Engine) -> None:
    bf16 = Engine(dtype="bfloat16", max_model_len=1024, kv_cache_memory=KV_MEMORY)
    assert bf16.core.worker.dtype == torch.bfloat16
    ids = engine.tokenizer.encode(NATURAL_PROMPTS[4])
    a = all_row_logits(bf16, ids, 8)
    b = all_row_logits(engine, ids, 8)
    assert relative_error(a, b) < 5e-2


def test_mlp_in_row_slices_equals_the_whole(engine: Engine) -> None:
    """A step of more than ``MLP_SLICE_ROWS`` rows runs its MLP in slices on a CPU (its
    temporaries stay small): the same rows as one matmul over all of them."""
    from chunkserve.model import layers

    mlp = engine.core.worker.model.layers[3].mlp
    x = torch.randn(2 * layers.MLP_SLICE_ROWS + 77, mlp.gate_up.in_features)
    sliced = mlp(x)
    torch.testing.assert_close(sliced, mlp.down(mlp._inner(x)), rtol=1e-5, atol=1e-5)
    assert mlp(x[:5]).shape == (5, x.shape[1])
