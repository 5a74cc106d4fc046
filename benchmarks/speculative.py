"""Speculative decoding on the embedded model: what n-gram drafts buy, and that chunking keeps
its stall-free tails with them.

1. **Decode speed.** Two workloads of chat prompts built from the shipped corpus: *repetitive*
   (copy or quote a passage of the prompt: the output repeats it) and *free* (write a story
   or an explanation: little to look up). At batch 1 (one request at a time) and batch 16
   (16 at once), speculation off against ``{"method": "ngram", "num_speculative_tokens":
   4}`` (the defaults otherwise). Decode tokens per second are the tokens the decode-only
   steps made over their time (no prefill in either side's number); greedy, so both sides
   should make the same tokens (exactly so in fp32; in bf16 a verify row's rounding may
   differ from a decode row's, and the table says whether they matched).
2. **The stall workload with speculation.** The same seeded stall workload (short chats at
   a Poisson rate, long documents every ``--long-interval`` s) replayed in process at the
   requests' arrival times, chunked (the defaults) and unchunked, with and without n-gram
   speculation: max ITL unchunked over chunked, with speculation and without.
3. **The draft-model path** on this CPU, with the target drafting for itself (every draft is
   accepted: the correctness configuration, not a speed-up: the draft costs what the target
   costs). Its cost on a GPU with dummy-weight shapes needs a GPU.

    python benchmarks/speculative.py --out-dir benchmarks/results/speculative

Writes ``results.json``, ``report.md`` and ``speedup.png`` there, with the machine, date and
commit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from chunkserve.bench.datasets import WorkloadSpec, build_workload
from chunkserve.bench.loadgen import summarize
from chunkserve.bench.prose import prose_text
from chunkserve.bench.replay import replay
from chunkserve.bench.sweep import machine_description
from chunkserve.engine.engine import Engine
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.model.loader import embedded_model_path, load_model_config, resolve_model
from chunkserve.provenance import git_commit
from chunkserve.scheduling.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
REPETITIVE = (
    "Copy the following passage exactly, word for word:\n\n{p}",
    "Quote this passage back to me verbatim, keeping every line break:\n\n{p}",
)
TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "how a steam engine works",
    "a city built on the back of a giant turtle",
    "why the sky is blue",
    "a chess match between two robots",
    "the history of bread",
    "a detective who can hear colours",
    "how bees decide where to build a hive",
)
FREE = (
    "Write a short story about {t}.",
    "Explain {t} to a curious child.",
)


def make_prompts(kind: str, n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    text = prose_text()
    out = []
    for i in range(n):
        if kind == "repetitive":
            start = rng.randrange(0, len(text) - 800)
            passage = text[start : start + rng.randint(400, 700)].strip()
            content = REPETITIVE[i % 2].format(p=passage)
        else:
            content = FREE[i % 2].format(t=TOPICS[i % len(TOPICS)])
        out.append([{"role": "user", "content": content}])
    return out


def decode_run(engine: Engine, conversations, batch: int, max_tokens: int) -> dict:
    """Generate for every conversation, ``batch`` at a time. Decode tok/s: each stream's
    tokens after its first over the time from its first token to its last (1 / TPOT), times
    the streams running together: what ``batch`` concurrent streams decode per second."""
    steps = []
    engine.step_listeners.append(steps.append)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tokens: list[list[int]] = []
    decode_tokens, decode_s, total_s = 0, 0.0, 0.0
    for i in range(0, len(conversations), batch):
        t0 = time.perf_counter()
        ids = [
            engine.add_request(engine.tokenizer.encode_chat(c), params)
            for c in conversations[i : i + batch]
        ]
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        total_s += time.perf_counter() - t0
        outs = [done[r] for r in ids]
        tokens.extend(o.token_ids for o in outs)
        decode_tokens += len(outs) * sum(len(o.token_ids) - 1 for o in outs)
        decode_s += sum(o.metrics.token_times[-1] - o.metrics.first_token_time for o in outs)
    engine.step_listeners.remove(steps.append)
    drafts = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    with_decodes = [s for s in steps if s.num_decode_tokens]
    return {
        "decode_tok_s": decode_tokens / decode_s,
        "output_tok_s": sum(len(t) for t in tokens) / total_s,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafts if drafts else None,
        "tokens_per_step": sum(s.num_generated_tokens for s in with_decodes)
        / max(1, sum(s.num_decode_tokens - s.num_draft_tokens for s in with_decodes)),
        "output_tokens": sum(len(t) for t in tokens),
        "tokens": tokens,
    }


def decode_section(args) -> list[dict]:
    """Off and n-gram alternately, ``--repeats`` times each (the VM's speed drifts between
    runs): medians, and every run's number."""
    off_engine = Engine(num_threads=args.threads, log_stats_interval=10**9)
    on_engine = Engine(speculative_config=NGRAM, num_threads=args.threads, log_stats_interval=10**9)
    rows = []
    for kind in ("repetitive", "free"):
        for batch in (1, 16):
            n = args.batch1_prompts if batch == 1 else batch
            convs = make_prompts(kind, n, seed=batch)
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            for _ in range(args.repeats):
                runs["off"].append(decode_run(off_engine, convs, batch, args.max_tokens))
                runs["ngram"].append(decode_run(on_engine, convs, batch, args.max_tokens))
            off, on = runs["off"][0], runs["ngram"][0]

            def med(side: str, key: str, runs=runs) -> float:
                return statistics.median(r[key] for r in runs[side])

            row = {
                "workload": kind,
                "batch": batch,
                "prompts": n,
                "off_tok_s": med("off", "decode_tok_s"),
                "ngram_tok_s": med("ngram", "decode_tok_s"),
                "off_runs": [r["decode_tok_s"] for r in runs["off"]],
                "ngram_runs": [r["decode_tok_s"] for r in runs["ngram"]],
                "off_output_tok_s": med("off", "output_tok_s"),
                "ngram_output_tok_s": med("ngram", "output_tok_s"),
                "acceptance": on["acceptance"],
                "tokens_per_step": on["tokens_per_step"],
                "identical_tokens": off["tokens"] == on["tokens"],
                "output_tokens": [off["output_tokens"], on["output_tokens"]],
                "dtype": str(off_engine.core.worker.dtype).removeprefix("torch."),
                "threads": off_engine.core.worker.num_threads,
            }
            row["speedup"] = row["ngram_tok_s"] / row["off_tok_s"]
            row["output_speedup"] = row["ngram_output_tok_s"] / row["off_output_tok_s"]
            rows.append(row)
            print(
                f"{kind:10s} batch {batch:2d}: off {row['off_tok_s']:.1f} tok/s, ngram "
                f"{row['ngram_tok_s']:.1f} tok/s ({row['speedup']:.2f}x), acceptance "
                f"{row['acceptance'] or 0:.2f}, identical {row['identical_tokens']}",
                flush=True,
            )
    return rows


def stall_section(args, tokenizer) -> dict:
    spec = WorkloadSpec(
        dataset="stall",
        num_prompts=args.stall_prompts,
        request_rate=args.request_rate,
        long_interval=args.long_interval,
    )
    workload = build_workload(spec, tokenizer)
    out = {}
    for name, kwargs in (
        ("chunked", {}),
        ("chunked+ngram", {"speculative_config": NGRAM}),
        ("unchunked", {"enable_chunked_prefill": False}),
        ("unchunked+ngram", {"enable_chunked_prefill": False, "speculative_config": NGRAM}),
    ):
        engine = Engine(num_threads=args.threads, log_stats_interval=10**9, **kwargs)
        records, duration = replay(engine, workload, max_duration=args.max_duration)
        s = summarize(records, duration)
        out[name] = {
            k: s[k]
            for k in (
                "completed",
                "failed",
                "output_throughput",
                "median_itl_ms",
                "p99_itl_ms",
                "max_itl_ms",
                "median_ttft_ms",
                "stalled_token_fraction",
            )
            if k in s
        }
        print(f"stall {name}: {out[name]}", flush=True)
    out["max_itl_gain"] = {
        "without_speculation": out["unchunked"]["max_itl_ms"] / out["chunked"]["max_itl_ms"],
        "with_ngram": out["unchunked+ngram"]["max_itl_ms"] / out["chunked+ngram"]["max_itl_ms"],
    }
    return out


def draft_section(args) -> dict:
    spec = {
        "method": "draft_model",
        "model": str(embedded_model_path()),
        "num_speculative_tokens": 3,
    }
    convs = make_prompts("repetitive", 2, seed=7)
    off = decode_run(
        Engine(num_threads=args.threads, log_stats_interval=10**9), convs, 1, args.max_tokens // 2
    )
    draft = Engine(speculative_config=spec, num_threads=args.threads, log_stats_interval=10**9)
    on = decode_run(draft, convs, 1, args.max_tokens // 2)
    res = {
        "draft": "the target itself (SmolLM2-135M)",
        "off_tok_s": off["decode_tok_s"],
        "draft_model_tok_s": on["decode_tok_s"],
        "ratio": on["decode_tok_s"] / off["decode_tok_s"],
        "acceptance": on["acceptance"],
        "identical_tokens": off["tokens"] == on["tokens"],
    }
    print(f"draft model (itself): {res}", flush=True)
    return res


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["off_tok_s"] for r in rows], 0.4, label="off")
    ax.bar([i + 0.2 for i in x], [r["ngram_tok_s"] for r in rows], 0.4, label="ngram (k=4)")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["ngram_tok_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode tokens / s")
    ax.set_title("n-gram speculative decoding, embedded model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(doc: dict) -> str:
    lines = [
        "# Speculative decoding (n-gram) on the embedded model",
        "",
        f"Machine: {doc['machine']}. Date: {doc['date']}. Commit: {doc['commit']}.",
        f"Command: `{doc['command']}`",
        "",
        "## Decode speed, speculation off vs n-gram (k=4)",
        "",
        "| workload | batch | decode tok/s off | ngram | speedup | output tok/s (prefill "
        "included) speedup | acceptance | tokens per decode per step | output tokens off / "
        "ngram | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["decode"]:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['ngram_tok_s']:.1f} "
            f"| {r['speedup']:.2f}x | {r['output_speedup']:.2f}x | {r['acceptance'] or 0:.2f} "
            f"| {r['tokens_per_step']:.2f} | {r['output_tokens'][0]} / {r['output_tokens'][1]} "
            f"| {r['identical_tokens']} |"
        )
    if doc["decode"]:
        r = doc["decode"][0]
        lines += ["", f"dtype {r['dtype']}, {r['threads']} torch threads (the defaults)."]
    if "stall" in doc:
        st = doc["stall"]
        lines += [
            "",
            "## Stall workload with speculation (in-process replay, same seeded load)",
            "",
            "| config | out tok/s | median ITL ms | p99 ITL ms | max ITL ms | stalled tokens |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("chunked", "chunked+ngram", "unchunked", "unchunked+ngram"):
            s = st[name]
            lines.append(
                f"| {name} | {s['output_throughput']:.1f} | {s['median_itl_ms']:.0f} | "
                f"{s['p99_itl_ms']:.0f} | {s['max_itl_ms']:.0f} | "
                f"{100 * s['stalled_token_fraction']:.1f}% |"
            )
        g = st["max_itl_gain"]
        lines += [
            "",
            f"Max ITL unchunked / chunked: {g['without_speculation']:.1f}x without "
            f"speculation, {g['with_ngram']:.1f}x with n-gram speculation.",
        ]
    if "draft_model" in doc:
        d = doc["draft_model"]
        lines += [
            "",
            "## Draft model (the target drafting for itself, k=3)",
            "",
            f"Acceptance {d['acceptance']:.2f}, same tokens {d['identical_tokens']}; decode "
            f"{d['draft_model_tok_s']:.1f} vs {d['off_tok_s']:.1f} tok/s ({d['ratio']:.2f}x): "
            f"a draft as large as the target costs more than it saves, as expected.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each side")
    ap.add_argument("--stall-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.4)
    ap.add_argument("--long-interval", type=float, default=15.0)
    ap.add_argument("--max-duration", type=float, default=600.0)
    ap.add_argument("--skip", default="", help="comma list of: decode,stall,draft")
    ap.add_argument("--out-dir", default="benchmarks/results/speculative")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {
        "benchmark": "speculative decoding",
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "command": "python benchmarks/speculative.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, "")
        ),
        "args": vars(args),
        "decode": [],
    }
    if "decode" not in skip:
        doc["decode"] = decode_section(args)
        plot(doc["decode"], out_dir / "speedup.png")
    if "stall" not in skip:
        source = resolve_model(None)
        tok = Tokenizer.from_source(source, load_model_config(source)[1], None)
        doc["stall"] = stall_section(args, tok)
    if "draft" not in skip:
        doc["draft_model"] = draft_section(args)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "report.md").write_text(report(doc))
    print(report(doc))


if __name__ == "__main__":
    main()
