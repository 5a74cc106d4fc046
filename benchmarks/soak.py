"""Soak: thousands of requests of every shape against one server, bad ones sprinkled in.

Valid requests mix completions and chat, streamed and not, ``n`` > 1, stop strings,
logprobs, and clients that go away at every stage: before the first token, after a few
streamed chunks, in the middle of a non-streamed generation. Bad requests (a list of
distinct invalid bodies) are mixed in at ``--bad-fraction``. With ``--control`` the same
seeded valid requests run first without the bad ones, so their inter-token latency can be
compared with the soak's.

Targets (issue 16): after the soak 0 KV blocks held, 0 5xx (or SSE error events) for valid
requests, 0 hung requests, every bad request a 4xx naming its field, server RSS growth under
10% between the 1,000th request and the last, and the valid requests' p99 ITL within 10% of
the control run.

    python benchmarks/soak.py                       # 2,000 requests, writes results/soak.*
    python benchmarks/soak.py --num-requests 70 --bad-fraction 0.55 --cover --warmup 0 \
        --prompt-chars 20,60,200,400 --out-dir /tmp/soak    # the CI-sized one: every plan
                                                            # and bad kind, few requests
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
RSS_PROBE_AT = 1000  # the "between the 1,000th request and the last"

# Distinct invalid requests: (path, body or raw text, the field the error must name).
BAD: list[tuple[str, dict[str, Any] | str, str | None]] = [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 9223372036854775808}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": 18446744073709551616}, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 16, "n": 16}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    (
        "/v1/completions",
        {"prompt": "x", "min_tokens": 1, "stop_token_ids": [999999999]},
        "stop_token_ids",
    ),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"12": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"cat": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 33}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["x" * 513]}, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**40}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "priority": 2**63}, "priority"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
        "response_format.json_schema",
    ),
    ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, "model"),
    ("/v1/completions", "{not json", None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
]

PLANS = (
    "stream",
    "stream",
    "nonstream",
    "chat_stream",
    "chat",
    "n2",
    "stop",
    "logprobs_stream",
    "abort_before_first",
    "abort_mid_stream",
    "abort_nonstream",
)


@dataclass
class Spec:
    index: int
    plan: str  # one of PLANS, or "bad"
    path: str
    body: dict[str, Any] | str
    stream: bool
    abort_after_s: float = 0.0  # abort_before_first / abort_nonstream
    abort_after_chunks: int = 0  # abort_mid_stream
    bad_param: str | None = None
    bad_kind: int | None = None  # the index in BAD


@dataclass
class Outcome:
    index: int
    plan: str
    bad_kind: int | None = None
    status: int | None = None
    error: str | None = None  # an error body or SSE error event, for a valid request
    hung: bool = False
    wrong_param: bool = False  # a bad request whose error names another field (or none)
    chunk_times: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def valid(self) -> bool:
        return self.plan != "bad"

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


PROMPT_CHARS = (40, 120, 400, 1200)  # the prompts' lengths in characters, drawn evenly


def prompt_text(rng: random.Random, text: str, lengths: tuple[int, ...] = PROMPT_CHARS) -> str:
    n = rng.choice(lengths)
    start = rng.randrange(0, len(text) - n)
    return text[start : start + n]


def valid_spec(
    index: int,
    rng: random.Random,
    text: str,
    max_tokens: int,
    plan: str | None = None,
    lengths: tuple[int, ...] = PROMPT_CHARS,
) -> Spec:
    drawn = rng.choice(PLANS)  # drawn even when given: one draw per request either way
    plan = plan or drawn
    n_out = rng.randint(max(2, max_tokens // 4), max_tokens)
    base: dict[str, Any] = {"model": MODEL, "max_tokens": n_out, "temperature": 0.0}
    if rng.random() < 0.3:
        base |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 31)}
    chat = plan in ("chat", "chat_stream")
    if chat:
        body = base | {"messages": [{"role": "user", "content": prompt_text(rng, text, lengths)}]}
        path = "/v1/chat/completions"
    else:
        body = base | {"prompt": prompt_text(rng, text, lengths), "ignore_eos": rng.random() < 0.5}
        path = "/v1/completions"
    stream = plan in ("stream", "chat_stream", "logprobs_stream", "abort_mid_stream")
    stream = stream or (plan in ("n2", "stop", "abort_before_first") and rng.random() < 0.5)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if plan == "n2":
        body["n"] = 2
    if plan == "stop":
        body["stop"] = [" the", "\n", "ing"]
        body["include_stop_str_in_output"] = rng.random() < 0.5
    if plan == "logprobs_stream":
        body["logprobs"] = 2
    spec = Spec(index, plan, path, body, stream)
    if plan == "abort_before_first":
        spec.abort_after_s = rng.uniform(0.0, 0.05)
    elif plan == "abort_nonstream":
        body["max_tokens"] = max_tokens * 4  # longer than the wait
        body["ignore_eos"] = True
        spec.abort_after_s = rng.uniform(0.05, 0.6)
    elif plan == "abort_mid_stream":
        spec.abort_after_chunks = rng.randint(1, 4)
    return spec


def build_specs(args: argparse.Namespace, with_bad: bool) -> list[Spec]:
    from chunkserve.bench.prose import prose_text

    text = prose_text()
    rng = random.Random(args.seed)  # the valid requests: the same with and without bad ones
    bad_rng = random.Random(args.seed + 1)
    # --cover: valid requests take the plans in turn (every kind in any len(PLANS) valid
    # requests) and bad ones the BAD list in turn (every kind in any len(BAD) bad requests).
    plans = sorted(set(PLANS))
    bad_order = list(range(len(BAD)))
    if args.cover:
        random.Random(args.seed + 2).shuffle(plans)
        random.Random(args.seed + 3).shuffle(bad_order)
    specs: list[Spec] = []
    num_valid = num_bad = 0
    for _ in range(args.num_requests):
        if with_bad and bad_rng.random() < args.bad_fraction:
            kind = bad_rng.randrange(len(BAD))
            if args.cover:
                kind = bad_order[num_bad % len(BAD)]
            num_bad += 1
            path, body, param = BAD[kind]
            if isinstance(body, dict) and path.startswith("/v1") and "model" not in body:
                body = {"model": MODEL, **body}
            specs.append(Spec(len(specs), "bad", path, body, False, bad_param=param, bad_kind=kind))
        else:
            plan = plans[num_valid % len(plans)] if args.cover else None
            num_valid += 1
            specs.append(
                valid_spec(len(specs), rng, text, args.max_tokens, plan, args.prompt_chars)
            )
    return specs


async def run_spec(client: httpx.AsyncClient, base: str, spec: Spec, timeout: float) -> Outcome:
    out = Outcome(spec.index, spec.plan, spec.bad_kind, start=time.perf_counter())
    try:
        if spec.plan in ("abort_before_first", "abort_nonstream"):
            task = asyncio.ensure_future(_call(client, base, spec, out))
            await asyncio.sleep(spec.abort_after_s)
            if not task.done():
                task.cancel()  # the client goes away: the connection closes
            await asyncio.gather(task, return_exceptions=True)
        else:
            await asyncio.wait_for(_call(client, base, spec, out), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        out.hung = True
    except httpx.HTTPError as exc:
        out.error = f"transport: {type(exc).__name__}: {exc}"
    out.end = time.perf_counter()
    return out


async def _call(client: httpx.AsyncClient, base: str, spec: Spec, out: Outcome) -> None:
    url = base + spec.path
    kw: dict[str, Any] = (
        {"content": spec.body, "headers": {"content-type": "application/json"}}
        if isinstance(spec.body, str)
        else {"json": spec.body}
    )
    if not spec.stream:
        r = await client.post(url, **kw)
        out.status = r.status_code
        _judge(spec, out, r.status_code, r.text)
        return
    async with client.stream("POST", url, **kw) as r:
        out.status = r.status_code
        if r.status_code != 200:
            _judge(spec, out, r.status_code, (await r.aread()).decode())
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = f"SSE error event: {event['error']}"
                return
            if event.get("choices"):
                out.chunk_times.append(time.perf_counter())
            if spec.abort_after_chunks and len(out.chunk_times) >= spec.abort_after_chunks:
                return  # leaving the block closes the stream mid-generation


def _judge(spec: Spec, out: Outcome, status: int, text: str) -> None:
    if spec.plan != "bad":
        if status != 200:
            out.error = f"HTTP {status}: {text[:200]}"
        return
    if not 400 <= status < 500:
        out.error = f"bad request answered {status}: {text[:200]}"
        return
    if spec.bad_param is not None:
        try:
            param = json.loads(text)["error"]["param"]
        except (ValueError, KeyError, TypeError):
            param = None
        out.wrong_param = param != spec.bad_param


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def run_phase(
    base: str, specs: list[Spec], args: argparse.Namespace, pid: int | None
) -> tuple[list[Outcome], list[tuple[int, float]]]:
    """All specs, ``args.concurrency`` at a time, in order; RSS sampled as requests end."""
    sem = asyncio.Semaphore(args.concurrency)
    done = 0
    rss: list[tuple[int, float]] = []
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:

        async def one(spec: Spec) -> Outcome:
            nonlocal done
            async with sem:
                out = await run_spec(client, base, spec, args.request_timeout)
            done += 1
            if done % 50 == 0 or done in (RSS_PROBE_AT, len(specs)):
                value = rss_mib(pid)
                if value is not None:
                    rss.append((done, value))
            return out

        outcomes = await asyncio.gather(*(one(s) for s in specs))
    return list(outcomes), rss


def wait_idle(base: str, timeout: float = 60.0) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.time() + timeout
    while True:
        values: dict[str, float] = {}
        text = httpx.get(base + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
        idle = (
            values.get("chunkserve:num_requests_running", 0) == 0
            and values.get("chunkserve:num_requests_waiting", 0) == 0
            and values.get("chunkserve:kv_cache_blocks_used", 0) == 0
        )
        if idle or time.time() > deadline:
            return values
        time.sleep(0.25)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summarize(outcomes: list[Outcome], rss: list[tuple[int, float]]) -> dict[str, Any]:
    valid = [o for o in outcomes if o.valid]
    bad = [o for o in outcomes if not o.valid]
    # Gaps of complete single-sequence streams (n=2 interleaves two sequences' chunks).
    skip = ("abort_before_first", "abort_mid_stream", "abort_nonstream", "n2")
    itls = [g for o in valid if o.plan not in skip for g in o.itls]
    by_plan: dict[str, int] = {}
    for o in outcomes:
        by_plan[o.plan] = by_plan.get(o.plan, 0) + 1
    probe = next((v for n, v in rss if n >= RSS_PROBE_AT), None)
    last = rss[-1][1] if rss else None
    return {
        "requests": len(outcomes),
        "valid": len(valid),
        "bad": len(bad),
        "by_plan": by_plan,
        "bad_kinds": len({o.bad_kind for o in bad}),
        "valid_errors": sum(o.error is not None for o in valid),
        "valid_error_examples": [o.error for o in valid if o.error][:5],
        "hung": sum(o.hung for o in outcomes),
        "bad_not_4xx": sum(o.error is not None for o in bad),
        "bad_wrong_param": sum(o.wrong_param for o in bad),
        "bad_examples": [o.error for o in bad if o.error][:5],
        "p50_itl_ms": _ms(percentile(itls, 0.5)),
        "p99_itl_ms": _ms(percentile(itls, 0.99)),
        "num_itls": len(itls),
        "rss_mib": rss,
        "rss_at_probe_mib": probe,
        "rss_last_mib": last,
        "rss_growth": (last - probe) / probe if probe and last else None,
        "wall_s": max(o.end for o in outcomes) - min(o.start for o in outcomes),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def report(doc: dict[str, Any]) -> str:
    meta, soak, control, end = doc["meta"], doc["soak"], doc.get("control"), doc["end"]
    t = doc["targets"]

    def mark(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    lines = [
        "# Soak",
        "",
        f"Measured {meta['date']} on {meta['machine']}; commit {meta['commit']}.",
        f"Server: `{meta['server']}`. Command: `{meta['command']}`.",
        "",
        f"{soak['requests']} requests ({soak['valid']} valid, {soak['bad']} bad of "
        f"{soak['bad_kinds']} kinds) at "
        f"concurrency {meta['concurrency']} in {soak['wall_s']:.0f} s. Plans: "
        + ", ".join(f"{k} {v}" for k, v in sorted(soak["by_plan"].items()))
        + ".",
        "",
        "| target | value | |",
        "|---|---|---|",
        f"| KV blocks held after the soak | {end['kv_blocks_used']:.0f} | {mark(t['no_blocks'])} |",
        f"| valid requests answered 5xx / error event | {soak['valid_errors']} | "
        f"{mark(t['no_valid_errors'])} |",
        f"| hung requests | {soak['hung']} | {mark(t['no_hung'])} |",
        f"| bad requests not a 4xx | {soak['bad_not_4xx']} | {mark(t['bad_all_4xx'])} |",
        f"| bad requests whose error names another field | {soak['bad_wrong_param']} | "
        f"{mark(t['bad_name_field'])} |",
        f"| RSS at request {RSS_PROBE_AT} -> last (MiB) | "
        f"{_fmt(soak['rss_at_probe_mib'])} -> {_fmt(soak['rss_last_mib'])} "
        f"({_pct(soak['rss_growth'])}) | {mark(t['rss_growth_under_10pct'])} |",
    ]
    if control is not None:
        lines.append(
            f"| valid p99 ITL, soak vs without bad requests (ms) | "
            f"{_fmt(soak['p99_itl_ms'])} vs {_fmt(control['p99_itl_ms'])} "
            f"({_pct(t['itl_ratio'] - 1 if t['itl_ratio'] else None)}) | "
            f"{mark(t['itl_within_10pct'])} |"
        )
    lines += ["", f"Server healthy after the soak: {end['healthy']}."]
    if soak["valid_error_examples"] or soak["bad_examples"]:
        lines += ["", "Examples of failures:", ""]
        lines += [f"- {e}" for e in soak["valid_error_examples"] + soak["bad_examples"]]
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--bad-fraction", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=24, help="valid requests' output cap")
    p.add_argument(
        "--prompt-chars",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=PROMPT_CHARS,
        help="the prompts' lengths in characters (comma-separated, drawn evenly; CI: shorter)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=120.0, help="later is 'hung'")
    p.add_argument("--control", action="store_true", help="also run without bad requests")
    p.add_argument(
        "--cover",
        action="store_true",
        help="plans and bad kinds in turn, not drawn: every kind in few requests",
    )
    p.add_argument("--warmup", type=int, default=10, help="valid requests before the soak")
    p.add_argument("--base-url", default=None, help="an existing server (default: start one)")
    p.add_argument(
        "--server-args",
        default="--max-model-len 1024 --kv-cache-memory 128MiB",
        help="flags for the server this script starts",
    )
    p.add_argument("--threads", type=int, default=None, help="the server's --num-threads")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or not 0 <= args.bad_fraction < 1:
        raise SystemExit("num_requests, concurrency >= 1 and 0 <= bad_fraction < 1")
    if not args.prompt_chars or min(args.prompt_chars) < 1:
        raise SystemExit("prompt_chars: lengths >= 1")

    from chunkserve.bench.sweep import ServerProcess
    from chunkserve.provenance import cpu_description, git_commit

    args.out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    command = [sys.executable, "-m", "chunkserve", "serve", "--log-level", "warning"]
    command += args.server_args.split()
    if args.threads is not None:
        command += ["--num-threads", str(args.threads)]
    if args.base_url is None:
        server = ServerProcess(command, args.out_dir / "soak_server.log")
        server.wait_healthy()
        base = server.base_url
    else:
        base = args.base_url.rstrip("/")
    pid = server.proc.pid if server else None
    try:
        if args.warmup > 0:
            warm = {"num_requests": args.warmup, "seed": args.seed + 7}
            warm_args = argparse.Namespace(**{**vars(args), **warm})
            asyncio.run(run_phase(base, build_specs(warm_args, with_bad=False), args, pid))
        control = None
        if args.control:
            outcomes, rss = asyncio.run(run_phase(base, build_specs(args, False), args, pid))
            control = summarize(outcomes, rss)
            wait_idle(base)
        outcomes, rss = asyncio.run(run_phase(base, build_specs(args, True), args, pid))
        soak = summarize(outcomes, rss)
        metrics = wait_idle(base)
        healthy = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        if server is not None:
            server.stop()
    end = {
        "kv_blocks_used": metrics.get("chunkserve:kv_cache_blocks_used", -1.0),
        "running": metrics.get("chunkserve:num_requests_running", -1.0),
        "waiting": metrics.get("chunkserve:num_requests_waiting", -1.0),
        "healthy": healthy,
    }
    ratio = (
        soak["p99_itl_ms"] / control["p99_itl_ms"]
        if control and soak["p99_itl_ms"] and control["p99_itl_ms"]
        else None
    )
    targets = {
        "no_blocks": end["kv_blocks_used"] == 0,
        "no_valid_errors": soak["valid_errors"] == 0,
        "no_hung": soak["hung"] == 0,
        "bad_all_4xx": soak["bad_not_4xx"] == 0,
        "bad_name_field": soak["bad_wrong_param"] == 0,
        "rss_growth_under_10pct": (
            None if soak["rss_growth"] is None else soak["rss_growth"] < 0.10
        ),
        "itl_ratio": ratio,
        "itl_within_10pct": None if ratio is None else ratio <= 1.10,
    }
    doc = {
        "meta": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": cpu_description() + ", CPU only",
            "commit": git_commit(),
            "command": "python benchmarks/soak.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "server": " ".join(command[1:]) if server else base,
            "concurrency": args.concurrency,
            "bad_fraction": args.bad_fraction,
            "num_bad_kinds": len(BAD),
        },
        "soak": soak,
        "control": control,
        "end": end,
        "targets": targets,
    }
    (args.out_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
    text = report(doc)
    (args.out_dir / "soak.md").write_text(text)
    print(text)
    # The exit status is correctness only; the RSS and ITL targets are in the report.
    correct = ("no_blocks", "no_valid_errors", "no_hung", "bad_all_4xx", "bad_name_field")
    return 0 if all(targets[k] for k in correct) and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
