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
from chunkserve.engine.engine import Engine
from chunkserve.provenance import git_commit
from chunkserve.scheduling.sampling_params import SamplingParams, StructuredOutputsParams

LONG_STRING = {
    "json": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "story": {"type": "string", "minLength": 600},
        },
        "required": ["title", "story"],
    }
}
NUMBER_ARRAY = {
    "json": {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "number"}, "minItems": 100}},
        "required": ["values"],
    }
}


def records(name_bounds: dict) -> dict:
    """A list of at least 20 records (name, age in a range, an enum), like tool arguments."""
    return {
        "json": {
            "type": "object",
            "properties": {
                "people": {
                    "type": "array",
                    "minItems": 20,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", **name_bounds},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "role": {"enum": ["engineer", "artist", "doctor", "pilot"]},
                        },
                        "required": ["name", "age", "role"],
                    },
                }
            },
            "required": ["people"],
        }
    }


# Constraints that keep generating for the whole round, four of each mix.
MIXES = {
    # What JSON APIs send: strings, numbers and enums without length bounds.
    "typical": {
        "long_string": LONG_STRING,
        "number_array": NUMBER_ARRAY,
        "records": records({}),
        "csv_regex": {"regex": r"([0-9]+,[a-z ]+\n)+"},
    },
    # Bounded repetition (maxLength, {m,n}): xgrammar checks more tokens at run time there
    # (single masks of 5-8 ms measured at some positions, vs microseconds elsewhere).
    "bounded": {
        "long_string": LONG_STRING,
        "number_array": NUMBER_ARRAY,
        "records_maxlength": records({"maxLength": 24}),
        "words_regex": {"regex": r"([A-Z][a-z]{1,10} ){200}"},
    },
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
    **MIXES["typical"],
    **MIXES["bounded"],
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


def round_(engine: Engine, prompts, mix: str | None, max_tokens: int) -> list:
    """All prompts at once; half constrained by the ``mix``'s constraints (none: free).
    Returns the StepStats of the decode-only steps with every request running."""
    n = len(prompts)
    constraints = list(MIXES[mix].values()) if mix else []
    stats: list = []
    engine.step_listeners.append(stats.append)
    try:
        for i, p in enumerate(prompts):
            so = None
            if constraints and i % 2 == 0:
                so = StructuredOutputsParams(**constraints[(i // 2) % len(constraints)])
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
    engine = Engine(max_model_len=1024, num_threads=args.num_threads)
    tok = engine.tokenizer
    prompts = [
        tok.encode_chat(
            [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]} ({i})."}]
        )
        for i in range(args.batch)
    ]
    # Warm-up: compile the grammars, prepare the vocabulary, warm the allocator.
    for mix in (*MIXES, None):
        round_(engine, prompts, mix, 8)
    order = ["free", *MIXES]
    sides: dict[str, list] = {side: [] for side in order}
    free_medians: list[float] = []
    for rep in range(args.repeats):
        for side in order if rep % 2 == 0 else order[::-1]:
            steps = round_(engine, prompts, None if side == "free" else side, args.max_tokens)
            sides[side].extend(steps)
            med = statistics.median(s.wall_time for s in steps) * 1e3
            if side == "free":
                free_medians.append(med)
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

    rows = {side: summary(steps) for side, steps in sides.items()}
    free = rows["free"]["median_step_ms"]
    for side in MIXES:
        rows[side]["ratio"] = rows[side]["median_step_ms"] / free
    info = engine.core.info()
    return {
        "batch": args.batch,
        "structured_requests": args.batch // 2,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "dtype": info.dtype,
        "num_threads": info.num_threads,
        "masks_overlap": engine.core.worker.runner.masks.overlap,
        "mixes": {m: list(MIXES[m]) for m in MIXES},
        "free_round_medians": free_medians,
        "sides": rows,
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
    c = doc["compile"]
    lines = [
        "# Structured outputs: mask cost per decode step, grammar compile time",
        "",
        f"Machine: {doc['machine']}. Date: {doc['date']}. Commit: {doc['commit']}.",
        "",
        f"Reproduce: `{doc['command']}`",
        "",
    ]
    for d in doc["decode"]:
        rows = d["sides"]
        where = "on a thread beside the forward pass" if d["masks_overlap"] else "before it"
        lines += [
            f"## Decode step, {d['batch']} running, {d['structured_requests']} with grammars "
            f"({d['num_threads']} threads)",
            "",
            f"Engine defaults but `num_threads` ({d['dtype']}, masks filled {where}). "
            f"Decode-only steps with all {d['batch']} requests running, {d['repeats']} "
            f"alternating rounds per side of {d['max_tokens']} tokens each (greedy, EOS "
            "ignored). Mixes: "
            + "; ".join(f"{m}: {', '.join(names)}" for m, names in d["mixes"].items())
            + ".",
            "",
            "| side | steps | median step ms | p90 step ms | median forward ms | mask fill ms "
            "| mask wait + apply ms | masked rows | step / free |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            ratio = f"**{row['ratio']:.3f}x**" if "ratio" in row else "1"
            lines.append(
                f"| {name} | {row['num_steps']} | {row['median_step_ms']:.1f} | "
                f"{row['p90_step_ms']:.1f} | {row['median_forward_ms']:.1f} | "
                f"{row['median_mask_fill_ms']:.2f} | {row['median_mask_wait_apply_ms']:.2f} | "
                f"{row['masked_rows']:.0f} | {ratio} |"
            )
        lines.append("")
        free = rows["free"]["median_step_ms"]
        for m in d["mixes"]:
            r, row = rows[m]["ratio"], rows[m]
            # The masks' own work on the step's path (less sensitive to the VM's drift
            # between rounds than the ratio of step medians).
            path = row["median_mask_wait_apply_ms"]
            if not d["masks_overlap"]:
                path += row["median_mask_fill_ms"]
            lines.append(
                f"- {m}: median step with grammars over without {r:.3f}x "
                f"(target <= 1.1x: {'met' if r <= 1.1 else 'NOT met'}); the masks' work on "
                f"the step's path {path:.1f} ms, {1 + path / free:.3f}x the free step."
            )
        lines += [
            "",
            "The free side's median moved between rounds: "
            + ", ".join(f"{x:.0f}" for x in d.get("free_round_medians", []))
            + " ms (this VM's speed drifts; rounds alternate so drift spreads over sides).",
            "",
        ]
    lines += [
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


def render(out_dir: Path) -> None:
    """Rewrite ``report.md`` from ``results.json`` (after a change of the report's text)."""
    doc = json.loads((out_dir / "results.json").read_text())
    (out_dir / "report.md").write_text(report(doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/structured_outputs"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument(
        "--threads",
        default="",
        help="comma-separated torch thread counts to run the decode section at besides the "
        "default (e.g. 1: masks then overlap on the spare core)",
    )
    args = ap.parse_args()
    doc = {
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "command": "python benchmarks/structured_outputs.py "
        f"--batch {args.batch} --max-tokens {args.max_tokens} --repeats {args.repeats}"
        + (f" --threads {args.threads}" if args.threads else ""),
        "compile": compile_section(),
        "decode": [],
    }
    for threads in [None] + [int(t) for t in args.threads.split(",") if t]:
        args.num_threads = threads
        doc["decode"].append(decode_section(args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = report(doc)
    (args.out_dir / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
