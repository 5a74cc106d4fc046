"""Prefill/decode disaggregation on this machine: a prefill instance and a decode instance of
one thread each behind ``chunkserve router``, against one colocated server of two threads,
and against two data-parallel servers of one thread each behind the router.

Every configuration runs the same seeded ``stall`` workload (short interactive prompts at
Poisson arrivals, long prose documents arriving at fixed intervals; identical prompts and
arrival times) through one base URL, streamed, with the load generator of
``chunkserve bench`` on the same machine. Servers run at their defaults (adaptive budget,
chunked prefill, prefix caching, shared-memory KV connector) plus the flags that make the
topology. Measured per configuration:

- client-observed TTFT p50/p99 (and per request kind), ITL p50/p99/max from SSE arrival
  times, output tokens/s, requests and errors;
- every instance's ``/metrics`` before and after the run (counters as deltas) and its
  ``kv_cache_blocks_used`` once the run is over (a leak shows as blocks still held);
- disaggregated only: KV transfer seconds on both sides per 1,000 prompt tokens the prefill
  instance computed, the decode side's wait for the KV, and the no-stall check: the run's
  max over median client ITL within ``NO_STALL_RATIO``.

    .venv/bin/python benchmarks/disaggregation.py --out-dir benchmarks/results/disaggregation

Writes ``results.json`` (machine, date, commit, command, workload, per-config metrics and
per-request data), ``report.md``, ``itl_ttft.png`` and one log per process there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.bench.args import workload_from_args
from chunkserve.bench.datasets import BenchRequest, WorkloadSpec
from chunkserve.bench.loadgen import RequestRecord, percentile, result_document, run
from chunkserve.bench.sweep import ServerProcess, machine_description
from chunkserve.provenance import git_commit

# The decode side of the disaggregated run counts as stall-free when its clients' worst
# inter-token gap is within this many times their median gap.
NO_STALL_RATIO = 1.5
STOP_TIMEOUT_S = 30.0  # SIGTERM, then SIGKILL after this long
SETTLE_TIMEOUT_S = 15.0  # after the run: wait this long at most for every instance to go idle
WARMUP_PROMPT_TOKENS = 256
WARMUP_MAX_TOKENS = 16
# Warm-up prompt ids: a run of ordinary vocabulary ids that no prose prompt starts with, so
# the warm-up leaves nothing in a prefix cache that the measured requests could hit.
WARMUP_FIRST_ID = 1000

# Samples read from each instance's /metrics. Counters and histogram sums/counts are
# reported as the run's delta (after - before); gauges as read once the run is over.
COUNTERS = (
    "chunkserve:prompt_tokens_total",
    "chunkserve:generation_tokens_total",
    "chunkserve:prefix_cache_queries_total",
    "chunkserve:prefix_cache_hits_total",
    "chunkserve:num_preemptions_total",
    "chunkserve:kv_transfer_seconds_sum",
    "chunkserve:kv_transfer_seconds_count",
    "chunkserve:kv_transfer_bytes_sum",
    "chunkserve:kv_transfer_bytes_count",
    "chunkserve:kv_transfer_wait_seconds_sum",
    "chunkserve:kv_transfer_wait_seconds_count",
)
GAUGES = (
    "chunkserve:kv_cache_blocks_used",
    "chunkserve:kv_cache_blocks_total",
    "chunkserve:num_requests_running",
    "chunkserve:num_requests_waiting",
    "chunkserve:num_requests_waiting_for_kv",
)
# The gauges that are 0 on an idle instance that holds no leaked state.
IDLE_GAUGES = (
    "chunkserve:kv_cache_blocks_used",
    "chunkserve:num_requests_running",
    "chunkserve:num_requests_waiting",
    "chunkserve:num_requests_waiting_for_kv",
)


def serve_command(threads: int, *flags: str) -> list[str]:
    """``chunkserve serve`` at its defaults; ``ServerProcess`` appends host and port."""
    return [
        sys.executable,
        "-m",
        "chunkserve",
        "serve",
        "--num-threads",
        str(threads),
        *flags,
        "--log-level",
        "warning",
    ]


ROUTER_COMMAND = [sys.executable, "-m", "chunkserve", "router", "--log-level", "warning"]


@dataclass(frozen=True)
class Topology:
    label: str
    instances: dict[str, list[str]]  # instance name -> chunkserve serve command, start order
    # instance name -> the router flag that lists it; empty: the client talks to the one
    # instance directly (no router).
    router_flags: dict[str, str] = field(default_factory=dict)


TOPOLOGIES: dict[str, Topology] = {
    "colocated": Topology(
        "one server, 2 threads",
        {"server": serve_command(2)},
    ),
    "disaggregated": Topology(
        "prefill + decode, 1 thread each, router",
        {
            "prefill": serve_command(1, "--disaggregation-mode", "prefill"),
            "decode": serve_command(1, "--disaggregation-mode", "decode"),
        },
        {"prefill": "--prefill", "decode": "--decode"},
    ),
    "data-parallel": Topology(
        "2 servers, 1 thread each, router",
        {"dp0": serve_command(1), "dp1": serve_command(1)},
        {"dp0": "--data-parallel", "dp1": "--data-parallel"},
    ),
}


@dataclass
class Deployment:
    """The processes of one configuration. Invariant: every process started is in
    ``processes`` (the router last), so stopping them all leaves nothing running."""

    name: str
    topology: Topology
    processes: dict[str, ServerProcess] = field(default_factory=dict)
    shutdown: dict[str, str] = field(default_factory=dict)  # process name -> how it ended

    @property
    def entry_url(self) -> str:
        """The base URL clients talk to: the router, or the only instance."""
        if "router" in self.processes:
            return self.processes["router"].base_url
        (only,) = self.processes.values()
        return only.base_url

    def instance_urls(self) -> dict[str, str]:
        return {n: self.processes[n].base_url for n in self.topology.instances}


def stop_process(server: ServerProcess) -> str:
    """Stops ``server`` (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``); how it ended."""
    server.proc.terminate()
    try:
        outcome = f"exited {server.proc.wait(STOP_TIMEOUT_S)} after SIGTERM"
    except subprocess.TimeoutExpired:
        server.proc.kill()
        outcome = f"KILLED: still running {STOP_TIMEOUT_S:g} s after SIGTERM"
    server.stop()  # reaps it (already exited: no signal sent) and closes its log
    return outcome


@contextlib.contextmanager
def deploy(name: str, topology: Topology, out_dir: Path) -> Iterator[Deployment]:
    """Starts the configuration's instances (together), waits for each ``/health``, then
    the router; stops every process it started, in reverse order, whatever happens."""
    dep = Deployment(name, topology)
    try:
        for inst, command in topology.instances.items():
            dep.processes[inst] = ServerProcess(command, out_dir / f"{name}_{inst}.log")
        for server in dep.processes.values():
            server.wait_healthy()
        if topology.router_flags:
            router_args: list[str] = []
            for inst, flag in topology.router_flags.items():
                router_args += [flag, dep.processes[inst].base_url]
            router = ServerProcess([*ROUTER_COMMAND, *router_args], out_dir / f"{name}_router.log")
            dep.processes["router"] = router
            router.wait_healthy()  # 200 only once the router reaches every instance
        yield dep
    finally:
        for proc_name in reversed(list(dep.processes)):
            try:
                dep.shutdown[proc_name] = stop_process(dep.processes[proc_name])
            except Exception as exc:  # stop the others anyway
                dep.shutdown[proc_name] = f"stop failed: {type(exc).__name__}: {exc}"
            print(f"   stopped {name}/{proc_name}: {dep.shutdown[proc_name]}", flush=True)


def scrape(base_url: str) -> dict[str, float]:
    """The ``COUNTERS`` and ``GAUGES`` samples of an instance, summed over label sets."""
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    wanted = set(COUNTERS) | set(GAUGES)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def scrape_all(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    return {name: scrape(url) for name, url in urls.items()}


def settle(urls: dict[str, str]) -> tuple[dict[str, dict[str, float]], float]:
    """Every instance's metrics once all are idle (``IDLE_GAUGES`` at 0), or as they are
    after ``SETTLE_TIMEOUT_S``; and the seconds waited."""
    t0 = time.perf_counter()
    while True:
        after = scrape_all(urls)
        idle = all(m.get(g, 0.0) == 0 for m in after.values() for g in IDLE_GAUGES)
        waited = time.perf_counter() - t0
        if idle or waited >= SETTLE_TIMEOUT_S:
            return after, waited
        time.sleep(0.5)


def instance_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as the run's delta, gauges as read after it."""
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    out.update({k: after.get(k, 0.0) for k in GAUGES})
    return out


def warm_up(base_url: str, count: int) -> None:
    """``count`` sequential requests through the entry point (one per instance behind a
    data-parallel router: it breaks load ties round-robin), so no measured request pays a
    first call's one-time costs."""
    for i in range(count):
        # A prompt of its own per request: each goes the whole way (no prefix-cache hit).
        first = WARMUP_FIRST_ID + i * WARMUP_PROMPT_TOKENS
        prompt = list(range(first, first + WARMUP_PROMPT_TOKENS))
        body = {"prompt": prompt, "max_tokens": WARMUP_MAX_TOKENS, "temperature": 0.0}
        resp = httpx.post(base_url + "/v1/completions", json=body, timeout=300.0)
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up request: HTTP {resp.status_code}: {resp.text[:300]}")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def percent(part: float | None, whole: float | None) -> float | None:
    r = ratio(part, whole)
    return None if r is None else 100 * r


def transfer_cost(
    prefill: dict[str, float], decode: dict[str, float], records: Sequence[RequestRecord]
) -> dict[str, float | None]:
    """KV transfer seconds per 1,000 prompt tokens. Denominator: the prefill instance's
    ``chunkserve:prompt_tokens`` delta, the prompt tokens it computed for the decode
    instance (each request's prompt but its last token; minus its own prefix-cache hits,
    whose blocks are sent too; plus any recomputation after a preemption, and the part of
    an aborted request's prompt computed before the abort). Cross-check from the client
    side: the tokens the decode instance asked for on behalf of the completed requests
    (prompt but the last token, minus what its own prefix cache held)."""
    tokens = prefill["chunkserve:prompt_tokens_total"]
    asked = sum(r.prompt_len - 1 for r in records if r.success)
    asked -= decode["chunkserve:prefix_cache_hits_total"]
    thousands = tokens / 1000 if tokens else None
    send_s = prefill["chunkserve:kv_transfer_seconds_sum"]
    copy_s = decode["chunkserve:kv_transfer_seconds_sum"]
    wait_s = decode["chunkserve:kv_transfer_wait_seconds_sum"]
    return {
        "prefill_prompt_tokens": tokens,
        "asked_tokens_completed_requests": asked,
        "prefill_prefix_cache_hit_tokens": prefill["chunkserve:prefix_cache_hits_total"],
        "decode_prompt_tokens": decode["chunkserve:prompt_tokens_total"],
        "prefill_transfers": prefill["chunkserve:kv_transfer_seconds_count"],
        "decode_transfers": decode["chunkserve:kv_transfer_seconds_count"],
        "prefill_bytes": prefill["chunkserve:kv_transfer_bytes_sum"],
        "decode_bytes": decode["chunkserve:kv_transfer_bytes_sum"],
        # Whole blocks move (a prompt's last block partly filled), so this is a little
        # above the cache's true bytes per token.
        "bytes_per_prompt_token": ratio(prefill["chunkserve:kv_transfer_bytes_sum"], tokens),
        "prefill_send_s": send_s,
        "decode_copy_s": copy_s,
        "prefill_send_s_per_1k_tokens": ratio(send_s, thousands),
        "decode_copy_s_per_1k_tokens": ratio(copy_s, thousands),
        "decode_wait_s_mean": ratio(wait_s, decode["chunkserve:kv_transfer_wait_seconds_count"]),
        "decode_copy_s_mean": ratio(copy_s, decode["chunkserve:kv_transfer_seconds_count"]),
    }


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], WorkloadSpec]:
    """The stall workload of ``chunkserve bench`` for these arguments; the dataset's own
    values for everything this script has no flag for."""
    spec_defaults = WorkloadSpec()
    workload_args = argparse.Namespace(
        dataset="stall",
        dataset_path=None,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=spec_defaults.burstiness,
        seed=args.seed,
        input_len=spec_defaults.input_len,
        output_len=spec_defaults.output_len,
        range_ratio=spec_defaults.range_ratio,
        long_interval=args.long_interval,
        num_long=0,
        tokenizer_model=None,
    )
    requests, spec = workload_from_args(workload_args)
    if args.output_len is not None:
        # Set after building: prompts, arrivals and long documents stay those of the
        # dataset for this seed; only the short requests' output lengths change.
        for r in requests:
            if r.kind == "short":
                r.output_len = args.output_len
        spec.short_output = (args.output_len, args.output_len)
    return requests, spec


def itl_max_over_median(records: Sequence[RequestRecord]) -> float | None:
    gaps = [g for r in records if r.success for g in r.itls]
    return ratio(max(gaps, default=None), percentile(gaps, 50) if gaps else None)


def run_config(
    name: str, requests: list[BenchRequest], args: argparse.Namespace, out_dir: Path
) -> dict[str, Any]:
    topology = TOPOLOGIES[name]
    if args.log_level != "warning":  # each instance's log gets its step lines
        topology = dataclasses.replace(
            topology,
            instances={
                n: [args.log_level if c == "warning" else c for c in cmd]
                + ["--decode-log-interval", str(args.decode_log_interval)]
                for n, cmd in topology.instances.items()
            },
        )
    print(f"== {name}: {topology.label}", flush=True)
    with deploy(name, topology, out_dir) as dep:
        urls = dep.instance_urls()
        warm_up(dep.entry_url, args.warmup * len(topology.instances))
        before = scrape_all(urls)
        records, duration = run(
            dep.entry_url + "/v1",
            requests,
            endpoint="completions",
            max_duration=args.max_duration,
            progress=sys.stderr.isatty(),
        )
        after, settle_s = settle(urls)
    metrics = {n: instance_metrics(before[n], after[n]) for n in urls}
    result: dict[str, Any] = {
        "name": name,
        "label": topology.label,
        "commands": {n: p.proc.args for n, p in dep.processes.items()},
        "metrics": metrics,
        "settle_s": settle_s,
        "leaked_kv_blocks": {n: m["chunkserve:kv_cache_blocks_used"] for n, m in metrics.items()},
        "shutdown": dep.shutdown,
        "itl_max_over_median": itl_max_over_median(records),
        **result_document(records, duration),  # its "errors": one entry per request
        "error_messages": sorted({r.error for r in records if r.error})[:10],
    }
    if name == "disaggregated":
        result["transfer"] = transfer_cost(metrics["prefill"], metrics["decode"], records)
    print(summary_line(result), flush=True)
    return result


def summary_line(r: dict[str, Any]) -> str:
    return (
        f"   {r['name']}: {r['completed']} ok, {r['failed']} failed; TTFT p50/p99 "
        f"{r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms; ITL p50/p99/max "
        f"{r['median_itl_ms']:.0f}/{r['p99_itl_ms']:.0f}/{r['max_itl_ms']:.0f} ms; "
        f"{r['output_throughput']:.1f} out tok/s; KV blocks used after: {r['leaked_kv_blocks']}"
    )


# ---- report ---------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _times(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _by_kind(r: dict[str, Any], kind: str, key: str) -> float | None:
    return (r.get("by_kind") or {}).get(kind, {}).get(key)


# (label, how to read it from a run, unit, higher is better)
COMPARED: tuple[tuple[str, Callable[[dict[str, Any]], float | None], str, bool], ...] = (
    ("TTFT p50", lambda r: r["median_ttft_ms"], "ms", False),
    ("TTFT p99", lambda r: r["p99_ttft_ms"], "ms", False),
    ("short-request TTFT p50", lambda r: _by_kind(r, "short", "median_ttft_ms"), "ms", False),
    ("long-document TTFT p50", lambda r: _by_kind(r, "long", "median_ttft_ms"), "ms", False),
    ("ITL p50", lambda r: r["median_itl_ms"], "ms", False),
    ("ITL p99", lambda r: r["p99_itl_ms"], "ms", False),
    ("ITL max", lambda r: r["max_itl_ms"], "ms", False),
    ("output throughput", lambda r: r["output_throughput"], "tok/s", True),
)


def _table(runs: list[dict[str, Any]]) -> list[str]:
    out = [
        "| config | requests | failed | TTFT p50 ms | TTFT p99 ms | TTFT p50 short / long ms | "
        "ITL p50 ms | ITL p99 ms | ITL max ms | ITL max / p50 | output tok/s | "
        "KV blocks used after |",
        "|" + "---|" * 12,
    ]
    for r in runs:
        blocks = ", ".join(f"{n} {v:.0f}" for n, v in r["leaked_kv_blocks"].items())
        out.append(
            f"| {r['name']} ({r['label']}) | {r['completed'] + r['failed']} | {r['failed']} | "
            f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
            f"{_fmt(_by_kind(r, 'short', 'median_ttft_ms'))} / "
            f"{_fmt(_by_kind(r, 'long', 'median_ttft_ms'))} | {r['median_itl_ms']:.0f} | "
            f"{r['p99_itl_ms']:.0f} | {r['max_itl_ms']:.0f} | "
            f"{_fmt(r['itl_max_over_median'], 2)} | {r['output_throughput']:.1f} | {blocks} |"
        )
    return out


def _transfer_lines(run_: dict[str, Any]) -> list[str]:
    t = run_["transfer"]
    ok = run_["itl_max_over_median"] is not None and run_["itl_max_over_median"] <= NO_STALL_RATIO
    return [
        "## KV transfer (disaggregated)",
        "",
        f"- Transfer cost: prefill-side send {_fmt(t['prefill_send_s_per_1k_tokens'], 4)} s "
        f"and decode-side copy {_fmt(t['decode_copy_s_per_1k_tokens'], 4)} s per 1,000 "
        f"prompt tokens ({t['prefill_send_s']:.3f} s and {t['decode_copy_s']:.3f} s over "
        f"{t['prefill_prompt_tokens']:.0f} tokens: the prefill instance's "
        "`chunkserve:prompt_tokens` delta, i.e. the tokens it computed for the decode instance; "
        f"the client-side count of tokens asked for by the completed requests is "
        f"{t['asked_tokens_completed_requests']:.0f}).",
        f"- {t['prefill_transfers']:.0f} transfers sent, {t['decode_transfers']:.0f} received; "
        f"{t['prefill_bytes'] / 2**20:.1f} MiB sent, {t['decode_bytes'] / 2**20:.1f} MiB "
        f"received ({_fmt(t['bytes_per_prompt_token'])} bytes per counted prompt token, whole "
        "blocks moved); the prefill instance's prefix cache supplied "
        f"{t['prefill_prefix_cache_hit_tokens']:.0f} of the tokens sent; the decode instance "
        f"computed {t['decode_prompt_tokens']:.0f} prompt tokens itself.",
        f"- Decode side, per request: {_fmt(ratio(t['decode_copy_s_mean'], 1e-3), 1)} ms "
        f"copying blocks into its pool; {_fmt(ratio(t['decode_wait_s_mean'], 1e-3))} ms from "
        "asking the prefill instance to the last block in (its queue and prefill included).",
        f"- No-stall check (client-observed ITL of the disaggregated run): max "
        f"{run_['max_itl_ms']:.0f} ms / median {run_['median_itl_ms']:.0f} ms = "
        f"{_times(run_['itl_max_over_median'])}: "
        f"{'within' if ok else 'NOT within'} {NO_STALL_RATIO:g}x"
        f"{'' if run_['completed'] else ' (no request completed)'}.",
        "",
    ]


def worst_gap_context(r: dict[str, Any]) -> str | None:
    """Where the run's worst inter-token gap fell against the long documents: inside one's
    wait for its first token (its prompt being computed, or on its way to the decode
    instance) or not, and how far from the nearest long document's first token (when a
    decode instance has just taken in its KV)."""
    gaps = [
        (b - a, a)
        for times in r["chunk_times"]
        for a, b in itertools.pairwise(times)  # consecutive tokens of one request
    ]
    if not gaps:
        return None
    gap, at = max(gaps)
    longs = [
        (i, start, start + ttft)
        for i, (kind, start, ttft) in enumerate(zip(r["kinds"], r["start_times"], r["ttfts"]))
        if kind == "long" and ttft is not None
    ]
    # The gap overlaps a long document's wait when it starts before that first token and
    # ends after the document was sent.
    inside = [f"#{i}" for i, start, first in longs if at < first and at + gap > start]
    where = (
        f"overlapping the wait for a first token of long document(s) {', '.join(inside)}"
        if inside
        else "outside every long document's wait for its first token"
    )
    nearest = min((abs(first - at) for _i, _start, first in longs), default=None)
    near = "" if nearest is None else f"; nearest long first token {nearest:.2f} s away"
    return f"worst gap {1e3 * gap:.0f} ms from t={at:.2f} s, {where}{near}"


def _winners(runs: list[dict[str, Any]]) -> list[str]:
    """One sentence per compared metric: the best configuration and the others relative
    to it; then measured facts behind them. Nothing here is written in advance."""
    done = [r for r in runs if r["completed"]]
    if len(done) < 2:
        return []
    out = ["## Where each wins, and why (computed from the numbers above)", ""]
    for label, get, unit, higher in COMPARED:
        vals = [(r["name"], get(r)) for r in done if get(r) is not None]
        if len(vals) < 2:
            continue
        best_name, best = (max if higher else min)(vals, key=lambda nv: nv[1])
        others = ", ".join(f"{n} {_fmt(ratio(v, best), 2)}x" for n, v in vals if n != best_name)
        word = "Highest" if higher else "Lowest"
        out.append(f"- {word} {label}: **{best_name}**, {best:.1f} {unit} ({others} of it).")
    wins: dict[str, int] = {r["name"]: 0 for r in done}
    for _label, get, _unit, higher in COMPARED:
        vals = [(r["name"], get(r)) for r in done if get(r) is not None]
        if len(vals) >= 2:
            wins[(max if higher else min)(vals, key=lambda nv: nv[1])[0]] += 1
    out.append(
        "- Metrics won: " + ", ".join(f"{n} {w} of {len(COMPARED)}" for n, w in wins.items()) + "."
    )
    out += ["", "Measured facts behind them:", ""]
    for r in done:
        preemptions = sum(m["chunkserve:num_preemptions_total"] for m in r["metrics"].values())
        out.append(
            f"- {r['name']}: max/median ITL {_times(r['itl_max_over_median'])}, "
            f"stalled tokens (gap > 3x median) {100 * r['stalled_token_fraction']:.2f}%, "
            f"long-document TTFT p50 {_fmt(_by_kind(r, 'long', 'median_ttft_ms'))} ms, "
            f"preemptions {preemptions:.0f}; {worst_gap_context(r) or 'no gaps'}."
        )
    disagg = next((r for r in done if r["name"] == "disaggregated"), None)
    if disagg is not None:
        t = disagg["transfer"]
        mean_ttft = disagg["mean_ttft_ms"]
        wait_ms = ratio(t["decode_wait_s_mean"], 1e-3)
        copy_ms = ratio(t["decode_copy_s_mean"], 1e-3)
        out.append(
            f"- disaggregated: the decode side waited {_fmt(wait_ms)} ms per request for "
            f"the KV ({_fmt(percent(wait_ms, mean_ttft))}% of its mean TTFT "
            f"{mean_ttft:.0f} ms); copying it in took {_fmt(copy_ms, 1)} ms of that "
            f"({_fmt(percent(copy_ms, wait_ms), 1)}%)."
        )
    return [*out, ""]


def write_report(out_dir: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    w = meta["workload"]
    lines = [
        "# Prefill/decode disaggregation vs colocated vs data parallel",
        "",
        f"Measured {meta['date']} on {meta['machine']}; commit {meta['commit']}; the load "
        "generator on the same machine.",
        f"Workload: `stall`, {meta['num_requests']} requests: {w['num_prompts']} short "
        f"({w['short_input'][0]}-{w['short_input'][1]} prompt tokens, "
        f"{w['short_output'][0]}-{w['short_output'][1]} output tokens) at {w['request_rate']:g} "
        f"req/s (Poisson), long prose documents of {w['long_input'][0]}-{w['long_input'][1]} "
        f"tokens ({w['long_output']} output tokens) every {w['long_interval']:g} s from "
        f"{w['long_start']:g} s; seed {w['seed']}; greedy, EOS ignored, streamed; "
        f"{meta['warmup']} warm-up request(s) per instance before each run (not measured).",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
        *_table(runs),
        "",
        "TTFT and ITL are client-observed (SSE arrival times); ITL max / p50 is the run's "
        "worst gap between two tokens over its median gap. KV blocks used after: "
        "`chunkserve:kv_cache_blocks_used` of each instance once the run was over (0: none "
        "leaked).",
        "",
    ]
    busy = [
        f"{r['name']}/{inst} {gauge.removeprefix('chunkserve:')} {m[gauge]:.0f}"
        for r in runs
        for inst, m in r["metrics"].items()
        for gauge in IDLE_GAUGES
        if m[gauge]
    ]
    if busy:
        lines += [
            f"Not idle {SETTLE_TIMEOUT_S:g} s after the run (a leak, or a gauge not updated "
            f"once idle): {'; '.join(busy)}.",
            "",
        ]
    disagg = next((r for r in runs if r["name"] == "disaggregated"), None)
    if disagg is not None:
        lines += _transfer_lines(disagg)
    lines += _winners(runs)
    failures = [(r["name"], e) for r in runs for e in r["error_messages"]]
    stops = [(r["name"], n, s) for r in runs for n, s in r["shutdown"].items()]
    if failures:
        lines += ["## Errors", "", *[f"- {n}: {e}" for n, e in failures], ""]
    lines += ["## Shutdown", "", *[f"- {c}/{n}: {s}" for c, n, s in stops], ""]
    lines += ["## Plot", "", "![ITL CDF and TTFT per configuration](itl_ttft.png)", ""]
    (out_dir / "report.md").write_text("\n".join(lines))


def _plain_log_ticks(axis: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k of a log axis, written as plain numbers."""
    import matplotlib.ticker

    axis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def write_plot(out_dir: Path, runs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        gaps = sorted(1e3 * g for per_request in r["itls"] for g in per_request)
        if gaps:
            ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
            a1.step(gaps, ys, where="post", label=r["name"])
    a1.set_xscale("log")
    _plain_log_ticks(a1.xaxis)
    a1.set_xlabel("inter-token latency (ms, client-observed)")
    a1.set_ylabel("fraction of gaps <= x")
    a1.set_title("ITL CDF")
    a1.grid(alpha=0.3)
    a1.legend()
    bars = (
        ("p50", lambda r: r["median_ttft_ms"]),
        ("p99", lambda r: r["p99_ttft_ms"]),
        ("p50 short", lambda r: _by_kind(r, "short", "median_ttft_ms")),
        ("p50 long", lambda r: _by_kind(r, "long", "median_ttft_ms")),
    )
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        xs = [j + i * width for j in range(len(bars))]
        a2.bar(xs, [get(r) or 0.0 for _label, get in bars], width, label=r["name"])
    a2.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(bars))])
    a2.set_xticklabels([label for label, _get in bars])
    if any((get(r) or 0.0) > 0 for r in runs for _label, get in bars):  # else: all failed
        a2.set_yscale("log")
        _plain_log_ticks(a2.yaxis)
    a2.set_ylabel("TTFT (ms)")
    a2.set_title("Time to first token")
    a2.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "itl_ttft.png", dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=40, help="short requests")
    p.add_argument("--request-rate", type=float, default=0.25, help="short requests per second")
    p.add_argument(
        "--long-interval",
        type=float,
        default=WorkloadSpec().long_interval,
        help="seconds between long documents",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens of every short request (default: the stall dataset's, "
        f"{WorkloadSpec().short_output[0]}-{WorkloadSpec().short_output[1]})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(TOPOLOGIES), help="comma list")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/disaggregation"))
    p.add_argument(
        "--max-duration", type=float, default=900.0, help="seconds per configuration's run"
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per instance")
    p.add_argument(
        "--log-level",
        default="warning",
        help="the servers' (info: every prefill or mixed step's line, decode steps in groups)",
    )
    p.add_argument(
        "--decode-log-interval",
        type=int,
        default=20,
        help="with --log-level info: decode steps per line (1: every step)",
    )
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in TOPOLOGIES]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(TOPOLOGIES)}")
    if args.num_prompts < 1 or not args.request_rate > 0 or not args.long_interval > 0:
        p.error("--num-prompts, --request-rate and --long-interval must be positive")
    if args.output_len is not None and args.output_len < 1:
        p.error("--output-len must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests, spec = build_workload(args)
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "commit": git_commit(),
        "command": shlex.join(["python", "benchmarks/disaggregation.py", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": dict(vars(spec)),
        "num_requests": len(requests),
        "num_long": sum(r.kind == "long" for r in requests),
        "warmup": args.warmup,
    }
    runs: list[dict[str, Any]] = []
    for name in args.configs:
        runs.append(run_config(name, requests, args, out_dir))
        # Written after every configuration: an interrupted run keeps what it measured.
        (out_dir / "results.json").write_text(
            json.dumps({"meta": meta, "runs": runs}, indent=1, default=str) + "\n"
        )
    write_report(out_dir, meta, runs)
    write_plot(out_dir, runs)
    print(f"wrote {out_dir}/results.json, report.md, itl_ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
