"""Issue 44's tool-calling targets, served (``chunkserve serve`` on the embedded model):

1. **Forced calls are valid**: ``--requests`` sampled (temperature 1) chat requests with
   ``tool_choice`` ``required`` or a named function, over tools with nested, enum, number
   and array arguments; every returned call's name must be a chosen tool and its arguments
   valid against that tool's JSON schema (``jsonschema``). Target: 100%.
2. **TTFT with a shared tools prefix**: a system prompt and tools of about 2,000 tokens
   (counted by /tokenize), then short user turns, streamed. The first request after the
   prefix cache is emptied computes the whole prompt; the next one, another question after
   the same prefix, hits it. Target: the second's TTFT <= 0.3x the first's (median of
   ``--pairs`` pairs).

    python benchmarks/tool_calls.py --out benchmarks/results/tool_calls.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
from api_server_util import ServeProcess  # (benchmarks/ is on the path of its scripts)

from chunkserve.bench.prose import prose_text
from chunkserve.bench.sweep import machine_description
from chunkserve.provenance import git_commit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string", "maxLength": 40},
                    "people": {"type": "integer", "minimum": 1, "maximum": 12},
                    "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                    "notes": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 20},
                        "maxItems": 3,
                    },
                },
                "required": ["restaurant", "people", "time"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert an amount between currencies",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "route": {
                        "type": "object",
                        "properties": {
                            "from": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
                            "to": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
                        },
                        "required": ["from", "to"],
                        "additionalProperties": False,
                    },
                },
                "required": ["amount", "route"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTIONS = [
    "What's the weather like in Lisbon?",
    "Book a table for four at Chez Marie at 19:30.",
    "How much is 120 euros in dollars?",
    "I need something for tonight.",
    "Help me plan my evening in Rome.",
]


def forced_validity(base: str, requests: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jobs = []
    for i in range(requests):
        named = rng.random() < 0.5
        choice = (
            {"type": "function", "function": {"name": rng.choice(list(schemas))}}
            if named
            else "required"
        )
        jobs.append((i, choice, rng.choice(QUESTIONS)))

    def one(job) -> dict:
        i, choice, question = job
        body = {
            "messages": [{"role": "user", "content": question}],
            "tools": TOOLS,
            "tool_choice": choice,
            "temperature": 1.0,
            "seed": seed + i,
            "max_tokens": 160,
        }
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        choice_out = r.json()["choices"][0]
        calls = choice_out["message"].get("tool_calls") or []
        allowed = set(schemas) if choice == "required" else {choice["function"]["name"]}
        problems = []
        if not calls:
            text = (choice_out["message"].get("content") or "")[:300]
            problems.append(f"no call ({choice_out['finish_reason']}): {text!r}")
        for call in calls:
            name = call["function"]["name"]
            if name not in allowed:
                problems.append(f"tool {name!r} not chosen")
                continue
            try:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                problems.append(f"{name}: {str(exc)[:120]}")
        return {"calls": len(calls), "problems": problems, "named": choice != "required"}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    seconds = time.perf_counter() - t0
    invalid = [r for r in results if r["problems"]]
    return {
        "requests": requests,
        "named": sum(r["named"] for r in results),
        "required": sum(not r["named"] for r in results),
        "calls": sum(r["calls"] for r in results),
        "valid_requests": requests - len(invalid),
        "valid_share": (requests - len(invalid)) / requests,
        "problems": [p for r in invalid for p in r["problems"]][:20],
        "seconds": round(seconds, 1),
    }


def long_prefix(base: str, target_tokens: int) -> tuple[list[dict], list[dict], int]:
    """A system prompt and tools of about ``target_tokens`` tokens: the tools above with
    long descriptions cut from the shipped prose."""
    prose = prose_text()
    system = {"role": "system", "content": "You are a concierge. " + prose[:2000]}
    tools = json.loads(json.dumps(TOOLS))
    at, size = 2000, 1200
    while True:
        probe = {"messages": [system, {"role": "user", "content": QUESTIONS[0]}], "tools": tools}
        count = httpx.post(base + "/tokenize", json=probe, timeout=60).json()["count"]
        if count >= target_tokens:
            return [system], tools, count
        tools[len(tools) - 1]["function"]["description"] += " " + prose[at : at + size]
        at += size


def ttft(base: str, messages: list[dict], tools: list[dict]) -> float:
    body = {
        "messages": messages,
        "tools": tools,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and (
                delta[0]["delta"].get("content")
                or delta[0]["delta"].get("tool_calls")
                or delta[0]["finish_reason"]
            ):
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def prefix_ttft(base: str, pairs: int, target_tokens: int) -> dict:
    system, tools, count = long_prefix(base, target_tokens)
    firsts, seconds_ = [], []
    for i in range(pairs):
        httpx.post(base + "/reset_prefix_cache", timeout=60).raise_for_status()
        a = QUESTIONS[(2 * i) % len(QUESTIONS)]
        b = QUESTIONS[(2 * i + 1) % len(QUESTIONS)]
        firsts.append(ttft(base, [*system, {"role": "user", "content": a}], tools))
        seconds_.append(ttft(base, [*system, {"role": "user", "content": b}], tools))
        print(f"pair {i}: first {firsts[-1]:.3f} s, second {seconds_[-1]:.3f} s", flush=True)
    first, second = statistics.median(firsts), statistics.median(seconds_)
    return {
        "prompt_tokens": count,
        "pairs": pairs,
        "ttft_first_s": [round(x, 3) for x in firsts],
        "ttft_second_s": [round(x, 3) for x in seconds_],
        "median_first_s": round(first, 3),
        "median_second_s": round(second, 3),
        "ratio": round(second / first, 3),
        "target_ratio": 0.3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-ttft", action="store_true", help="only the forced calls")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tool_calls.json"))
    args = ap.parse_args()
    flags = [
        "--max-model-len",
        "4096",
        "--kv-cache-memory",
        "512MiB",
        "--num-threads",
        str(args.threads),
        "--log-level",
        "warning",
        # A loaded shared machine can go minutes between steps: not a hang.
        "--watchdog-timeout",
        "900",
    ]
    with ServeProcess(*flags) as server:
        prefix = None
        if not args.skip_ttft:
            prefix = prefix_ttft(server.base, args.pairs, args.prefix_tokens)
        print(json.dumps(prefix), flush=True)
        forced = forced_validity(server.base, args.requests, args.concurrency, args.seed)
        print(json.dumps(forced), flush=True)
    result = {
        "machine": machine_description() + " (shared 2-core machine, other jobs running)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "model": "embedded SmolLM2-135M (server defaults: its dtype, adaptive budget)",
        "server_flags": flags,
        "forced_calls": forced,
        "tools_prefix_ttft": prefix,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
