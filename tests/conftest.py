"""Shared fixtures: the embedded model, an fp32 HF transformers reference of it (cached as an
HF safetensors directory, which also exercises our safetensors loader), prompts."""

from __future__ import annotations

import ctypes
import gc
import os
import random
from pathlib import Path

import pytest
import torch

from chunkserve.model.loader import embedded_model_path

# Without CUDA, the Triton attention kernels run under Triton's interpreter (numpy on the
# CPU): set before any kernel module is imported, since @triton.jit reads it then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Parallel test workers (pytest-xdist, ``make test``) share the cores: each worker's torch,
# and the servers, engine cores and ranks its tests start (through OMP_NUM_THREADS), take
# cores / workers threads. More threads than cores make every step wait for the slowest.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


def _fix_triton_interpreter_scalars() -> None:
    """Triton's interpreter (3.6) holds scalars as 1-element arrays and converts them for
    ``range()`` with ``int(array)``, which numpy 2.4 rejects: kernels whose loop bound is
    loaded from memory fail under it (compiled kernels are unaffected)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton version: nothing to fix, or fixed upstream
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


_fix_triton_interpreter_scalars()

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CHUNKSERVE_TEST_CACHE", REPO / ".cache" / "tests"))

NATURAL_PROMPTS = [
    "The capital of France is",
    "Write a haiku about rain.",
    "def fibonacci(n):",
    "List three uses of copper:",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Once upon a time, in a kingdom by the sea, there lived",
]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids of ordinary vocabulary (ids 100..48999, no special tokens)."""
    return [rng.randrange(100, 49_000) for _ in range(n)]


@pytest.fixture(scope="session")
def shared_engine():
    """One fp32 engine of the embedded model for every test that only needs a loaded model
    (not a particular budget or cache layout): each load costs seconds. Tests leave it as
    they found it: every request finished, no blocks held."""
    from chunkserve.engine.engine import Engine

    engine = Engine(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    yield engine
    assert_no_blocks_in_use(engine)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_dir() -> Path:
    """An HF-format copy of the embedded model (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json), built once from the GGUF with transformers."""
    from chunkserve.bench.embedded_hf import embedded_hf_copy

    return embedded_hf_copy(CACHE / "smollm2-hf")


@pytest.fixture(scope="session")
def hf_model(hf_dir: Path):
    """HF transformers' LlamaForCausalLM in fp32: the numerical reference."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    return model


def mixed_prompts(n: int) -> list[list[int]]:
    """``n`` prompts of mixed lengths (2 to 40 tokens), the same every call."""
    rng = random.Random(42)
    return [random_prompt(rng, rng.choice([2, 3, 5, 9, 14, 20, 40])) for _ in range(n)]


def run_among(
    engine,
    prompts: list[list[int]],
    at: int = 0,
    max_tokens: int = 3,
    cached: list[int] | None = None,
    per_arrival: int = 2,
    params=None,
) -> tuple[list[int], list]:
    """The result (token ids, logprobs with their top-2) of ``prompts[at]``, the prompts
    added ``per_arrival`` at a time every other step (so chunks, decodes and arrivals mix);
    its prompt tokens taken from the prefix cache appended to ``cached``. ``params``: the
    requests' sampling (default: greedy, exactly ``max_tokens`` tokens, top-2 logprobs)."""
    from chunkserve.scheduling.sampling_params import SamplingParams

    params = params or SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, logprobs=2
    )
    pending, ids, results, step = list(prompts), [], {}, 0
    while engine.has_unfinished() or pending:
        if pending and step % 2 == 0:
            for _ in range(min(per_arrival, len(pending))):
                ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            if out.finished:
                lps = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
                results[out.request_id] = (out.token_ids, lps)
                if cached is not None and out.request_id == ids[at]:
                    cached.append(out.num_cached_tokens)
        step += 1
    assert_no_blocks_in_use(engine)
    return results[ids[at]]


def assert_no_blocks_in_use(engine) -> None:
    kv = engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{kv.num_blocks - kv.num_free_blocks} KV blocks still allocated"
    )
    kv.pool.check_invariants()
    assert not engine.has_unfinished()


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Configuration errors must come before the weights load (seconds a user waits for
    nothing): loading fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the configuration was checked")

    monkeypatch.setattr("chunkserve.model.decoder.DecoderLM.load_weights", refuse)


@pytest.fixture(scope="session", autouse=True)
def _embedded_weights_once():
    """The embedded model's weights decoded once per dtype (and kept quantized or not) for
    the whole session: every in-process engine otherwise spends seconds in the dequantiser
    (or copying the blocks) for the same bytes (quantized weights are never modified in
    place: engines may share them).
    Loading still goes through ``load_weights`` (names, shapes, the copy into our fused
    layout); only the file's decoding is shared. Other files are read as usual."""
    import chunkserve.worker.draft_model as draft_model
    import chunkserve.worker.worker as worker
    from chunkserve.model import loader
    from chunkserve.model.lazy import LazyTensor

    try:
        embedded = Path(embedded_model_path()).resolve()
    except ValueError:  # not installed (a GPU check of the tiny-model tests): nothing to share
        yield
        return
    decoded: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    original = loader.iter_weights

    def iter_weights(source, config, reader, dtype, quantized=False):
        if source.kind != "gguf" or Path(source.path).resolve() != embedded:
            return original(source, config, reader, dtype, quantized)
        key = (dtype, repr(config), quantized)
        if key not in decoded:  # read once (lazily read tensors: read whole, here)
            decoded[key] = [
                (name, t.full() if isinstance(t, LazyTensor) else t)
                for name, t in original(source, config, reader, dtype, quantized)
            ]
        return iter(decoded[key])

    patch = pytest.MonkeyPatch()
    for module in (worker, draft_model):
        patch.setattr(module, "iter_weights", iter_weights)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def preemption_reference() -> list[list[int]]:
    """Greedy tokens of the preemption workload (``tests.test_invariance``) run unchunked in
    a pool with room to spare: the reference that preempted runs (plain, speculative,
    tensor-parallel) must reproduce. Computed once for the session."""
    from tests.test_invariance import (
        PREEMPT_TOKENS,
        make_engine,
        preemption_workload,
        run_staggered,
    )

    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=2048)
    tokens = run_staggered(engine, preemption_workload(), PREEMPT_TOKENS)
    assert engine.core.scheduler.num_preemptions == 0
    assert_no_blocks_in_use(engine)
    return tokens


def _release_freed_memory() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``). A test
    module's engines and models are freed when its fixtures end, but glibc keeps most of
    those pages: after tests/test_invariance.py a process held 5.8 GB, 5.4 GB after
    ``gc.collect()`` and 1.0 GB after the trim. Two test workers growing like that filled
    this 24 GB machine."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (glibc only; musl and macOS lack it)
except (OSError, AttributeError):
    _LIBC = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test module's last test, once its module-scoped fixtures have ended."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not item.module:
        _release_freed_memory()
    return result


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that starts a tensor-parallel engine in this process sets torch's thread
    count for its ranks; the next test gets the process's count back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class StepClock:
    """A fake clock for ``EngineCore.clock``: it moves only when a step's forward pass runs,
    by a fixed cost plus a cost per batched token (``pin_step_times``). Step times, and all
    the engine decides from them (the adaptive budget, which drafts pay), are then the same
    on any machine, however loaded."""

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pin_step_times(engine, fixed: float = 0.02, per_token: float = 2e-4) -> StepClock:
    """Time ``engine``'s steps (an in-process ``Engine``) on a ``StepClock``."""
    core = engine.core
    clock = StepClock(fixed, per_token)
    execute = core.worker.execute

    def timed(out):
        result = execute(out)
        clock.now += clock.fixed + clock.per_token * out.num_batched_tokens
        return result

    core.worker.execute = timed
    core.clock = clock
    return clock


# The modules that take longest, longest first (tests' seconds in a run of the whole suite,
# 27 Nov 2026). ``make test`` hands whole modules to its workers in collection order
# (``--dist loadfile --no-loadscope-reorder``); xdist's own reorder runs the modules with the
# most tests first, which left single-test heavyweights (the soak) for the end and one
# worker running alone. Longest first leaves the short modules to fill both workers' ends.
# A module not listed runs after these, in file order. The order changes no result.
LONGEST_FIRST = (
    "test_deterministic",
    "test_tensor_parallel",
    "test_speculative",
    "test_invariance",
    "test_quant_model",
    "test_disaggregation",
    "test_gguf",
    "test_soak",
    "test_server",
    "test_structured",
    "test_hybrid_kv",
    "test_core_process",
    "test_prefix_cache",
    "test_model_parity",
    "test_bench",
    "test_deepseek",
    "test_prompt_logprobs",
    "test_fuzz_api",
    "test_gpt_oss",
    "test_lm_eval",
    "test_async_engine",
    "test_sampler",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).stem, len(rank)))
