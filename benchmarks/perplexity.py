"""Perplexity of the shipped prose (``chunkserve.bench.prose``, Shakespeare) through the
API, the way evaluators score text: ``/v1/completions`` with ``echo``, ``logprobs`` and
``max_tokens: 0`` on windows of the corpus; the prompt's token logprobs (each window's first
token has none) give the perplexity. Run on two servers, chunked (a small step budget: each
prompt in several prefill chunks) and unchunked (a budget above the window), with
``--deterministic`` so the two may be compared bit for bit; also without it (the default
kernels: chunking changes the fp32 reductions, so only about 1e-6 relatively).

    python benchmarks/perplexity.py --out benchmarks/results/perplexity.json

Writes the machine, date, commit, the perplexities and the seconds each run took.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import httpx
from api_server_util import ServeProcess  # (benchmarks/ is on the path of its scripts)

from chunkserve.bench.prose import prose_tokens
from chunkserve.bench.sweep import machine_description
from chunkserve.provenance import git_commit


def windows(num: int, length: int) -> list[list[int]]:
    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import embedded_model_path, open_gguf

    path = embedded_model_path()
    tokens = prose_tokens(Tokenizer.from_gguf(path, open_gguf(path)))
    return [tokens[i * length : (i + 1) * length] for i in range(num)]


def score(base: str, prompts: list[list[int]]) -> tuple[list[float], float]:
    logprobs: list[float] = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        for ids in prompts:
            body = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}
            r = client.post(base + "/v1/completions", json=body)
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert lps[0] is None and len(lps) == len(ids)
            logprobs += lps[1:]
    return logprobs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64, help="step budget of the chunked run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/perplexity.json"))
    args = ap.parse_args()
    prompts = windows(args.windows, args.length)
    common = [
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.length + 16),
        "--kv-cache-memory",
        "128MiB",
        "--num-threads",
        str(args.threads),
        "--log-level",
        "warning",
    ]
    runs = {}
    for deterministic in (True, False):
        for name, budget in (("chunked", args.chunk), ("unchunked", args.length + 16)):
            flags = [*common, "--max-num-batched-tokens", str(budget)]
            if deterministic:
                flags.append("--deterministic")
            with ServeProcess(*flags) as server:
                lps, seconds = score(server.base, prompts)
            key = f"{name}{'_deterministic' if deterministic else ''}"
            runs[key] = {
                "budget": budget,
                "deterministic": deterministic,
                "tokens_scored": len(lps),
                "perplexity": math.exp(-sum(lps) / len(lps)),
                "seconds": round(seconds, 2),
                "_lps": lps,
            }
            print(key, runs[key]["perplexity"], f"{seconds:.1f} s", flush=True)
    det_equal = runs["chunked_deterministic"]["_lps"] == runs["unchunked_deterministic"]["_lps"]
    a, b = runs["chunked"]["_lps"], runs["unchunked"]["_lps"]
    max_diff = max(abs(x - y) for x, y in zip(a, b))
    for r in runs.values():
        r.pop("_lps")
    result = {
        "machine": machine_description() + " (shared 2-core machine, other jobs running)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "model": "embedded SmolLM2-135M, fp32",
        "windows": args.windows,
        "window_tokens": args.length,
        "runs": runs,
        "deterministic_chunked_equals_unchunked_bitwise": det_equal,
        "default_kernels_max_token_logprob_diff": max_diff,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
