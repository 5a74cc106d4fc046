"""Structured outputs on the embedded model: what grammar masks cost a decode step, and what
compiling a grammar costs.

1. **Decode step time.** 64 requests decode together (chat prompts, greedy, EOS ignored);
   in one round none has a grammar, in the other 32 of them do (JSON schemas with long
   strings, arrays of numbers, nested objects, and a regex: constraints that keep generating
   for the whole round, mixed as a server would see them). Rounds alternate (``--repeats``
   of each, same engine, the defaults otherwise), and the decode-only steps with all 64
   running are timed: median step time with grammars over without (target <= 1.1x), and
   the masks' own cost per step: filling them (on the mask thread, beside the forward pass)
   and what sampling waited for and spent applying them after it.
2. **Compile time per schema**, first and cached, through the engine core's compiler (after
   the vocabulary is prepared once; that is timed too).

    python benchmarks/structured_outputs.py --out-dir benchmarks/results/structured_outputs

Writes ``results.json`` and ``report.md`` there, with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from chunkserve.bench.sweep import machine_description
from chunkserve.engine import Engine
from chunkserve.provenance import git_commit
from chunkserve.request import SamplingParams, StructuredOutputsParams

CONSTRAINTS = {
    "long_string": {
        "json": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
            "required": ["title", "story"],
        }
    },
    "number_array": {
        "json": {
            "type": "object",
            "properties": {
                "values": {"type": "array", "items": {"type": "number"}, "minItems": 100}
            },
            "required": ["values"],
        }
    },
    "nested": {
        "json": {
            "type": "object",
            "properties": {
                "people": {
                    "type": "array",
                    "minItems": 20,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 24},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "role": {"enum": ["engineer", "artist", "doctor", "pilot"]},
                        },
                        "required": ["name", "age", "role"],
                    },
                }
            },
            "required": ["people"],
        }
    },
    "regex": {"regex": r"([A-Z][a-z]{1,10} ){200}"},
}
TOPICS = (
    "a lighthouse keeper",
    "how a steam engine works",
    "a city on a giant turtle",
    "why the sky is blue",
    "two robots playing chess",
    "the history of bread",
    "a detective who hears colours",
    "how bees choose a home",
)
# Schemas whose compile time is reported (the decode ones and a few of the tests').
COMPILE_SCHEMAS = {
    **{k: v for k, v in CONSTRAINTS.items()},
    "person": {
        "json": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "format": "email"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age"],
        }
    },
    "json_object": {"json_object": True},
    "choice": {"choice": ["positive", "negative", "neutral"]},
}


def round_(engine: Engine, prompts, structured: bool, max_tokens: int) -> list:
    """64 requests at once; half constrained if ``structured``. Returns the StepStats of
    the decode-only steps with every request running."""
    n = len(prompts)
    names = list(CONSTRAINTS)
    stats: list = []
    engine.step_listeners.append(stats.append)
    try:
        for i, p in enumerate(prompts):
            so = None
            if structured and i % 2 == 0:
                so = StructuredOutputsParams(**CONSTRAINTS[names[(i // 2) % len(names)]])
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=so
            )
            engine.add_request(prompt_token_ids=p, sampling_params=params)
        finished = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.finish_reason
    finally:
        engine.step_listeners.remove(stats.append)
    stops = sum(1 for r in finished.values() if r != "length")
    if stops:
        print(f"  ({stops} requests ended before max_tokens)")
    return [s for s in stats if s.kind == "decode" and s.num_decode_tokens == n]


def decode_section(args) -> dict:
    engine = Engine(max_model_len=1024)
    tok = engine.tokenizer
    prompts = [
        tok.encode_chat(
            [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]} ({i})."}]
        )
        for i in range(args.batch)
    ]
    # Warm-up: compile the grammars, prepare the vocabulary, warm the allocator.
    round_(engine, prompts, True, 8)
    round_(engine, prompts, False, 8)
    sides: dict[str, list] = {"free": [], "structured": []}
    for rep in range(args.repeats):
        for side in ("free", "structured") if rep % 2 == 0 else ("structured", "free"):
            steps = round_(engine, prompts, side == "structured", args.max_tokens)
            sides[side].extend(steps)
            med = statistics.median(s.wall_time for s in steps) * 1e3
            print(f"repeat {rep} {side}: {len(steps)} decode steps, median {med:.1f} ms")

    def summary(steps) -> dict:
        def med(key: str) -> float:
            return statistics.median(getattr(s, key) for s in steps) * 1e3

        return {
            "num_steps": len(steps),
            "median_step_ms": med("wall_time"),
            "p90_step_ms": statistics.quantiles([s.wall_time for s in steps], n=10)[-1] * 1e3,
            "median_forward_ms": med("forward_time"),
            "median_mask_fill_ms": med("mask_time"),
            "median_mask_wait_apply_ms": med("mask_wait_time"),
            "masked_rows": statistics.median(s.num_masked_rows for s in steps),
        }

    free, structured = summary(sides["free"]), summary(sides["structured"])
    return {
        "batch": args.batch,
        "structured_requests": args.batch // 2,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "dtype": engine.core.info().dtype,
        "num_threads": engine.core.info().num_threads,
        "free": free,
        "structured": structured,
        "ratio": structured["median_step_ms"] / free["median_step_ms"],
    }


def compile_section() -> dict:
    engine = Engine(max_model_len=512, kv_cache_memory=32 << 20)
    grammars = engine.core.grammars
    t0 = time.perf_counter()
    grammars._xgr_compiler()  # the vocabulary, once per engine
    vocab_s = time.perf_counter() - t0
    rows = {}
    for name, fields in COMPILE_SCHEMAS.items():
        params = StructuredOutputsParams(**fields)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            _, cached = grammars.compile(params)
            times.append((time.perf_counter() - t, cached))
        assert not times[0][1] and times[1][1]
        rows[name] = {"first_ms": times[0][0] * 1e3, "cached_ms": times[1][0] * 1e3}
    return {"vocabulary_s": vocab_s, "schemas": rows}


def report(doc: dict) -> str:
    d, c = doc["decode"], doc["compile"]
    f, s = d["free"], d["structured"]
    met = "met" if d["ratio"] <= 1.1 else "NOT met"
    lines = [
        "# Structured outputs: mask cost per decode step, grammar compile time",
        "",
        f"Machine: {doc['machine']}. Date: {doc['date']}. Commit: {doc['commit']}.",
        f"Engine defaults (dtype {d['dtype']}, {d['num_threads']} threads).",
        "",
        f"Reproduce: `{doc['command']}`",
        "",
        f"## Decode step, {d['batch']} running, {d['structured_requests']} with grammars",
        "",
        f"Decode-only steps with all {d['batch']} requests running, {d['repeats']} alternating "
        f"rounds per side of {d['max_tokens']} tokens each (greedy, EOS ignored).",
        "",
        "| side | steps | median step ms | p90 step ms | median forward ms | mask fill ms "
        "(beside the forward) | mask wait + apply ms | masked rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in (("no grammars", f), (f"{d['structured_requests']} grammars", s)):
        lines.append(
            f"| {name} | {row['num_steps']} | {row['median_step_ms']:.1f} | "
            f"{row['p90_step_ms']:.1f} | {row['median_forward_ms']:.1f} | "
            f"{row['median_mask_fill_ms']:.2f} | {row['median_mask_wait_apply_ms']:.2f} | "
            f"{row['masked_rows']:.0f} |"
        )
    lines += [
        "",
        f"Median step with grammars over without: **{d['ratio']:.3f}x** (target <= 1.1x: {met}).",
        "",
        "## Grammar compile time",
        "",
        f"The vocabulary is prepared once per engine, at the first grammar: "
        f"{c['vocabulary_s']:.2f} s (off the step loop, on the compile thread).",
        "",
        "| constraint | first compile ms | cached ms |",
        "|---|---|---|",
    ]
    for name, row in c["schemas"].items():
        lines.append(f"| {name} | {row['first_ms']:.2f} | {row['cached_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/structured_outputs"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    doc = {
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "command": "python benchmarks/structured_outputs.py "
        f"--batch {args.batch} --max-tokens {args.max_tokens} --repeats {args.repeats}",
        "compile": compile_section(),
        "decode": decode_section(args),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = report(doc)
    (args.out_dir / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
