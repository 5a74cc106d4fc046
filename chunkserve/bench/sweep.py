"""``chunkserve bench sweep``: start a server per configuration (chunking off, the defaults,
then each static budget, then peers), run the same seeded workload against each, at one or
more request rates, and write ``benchmarks/results/<name>/``: ``report.md``, ``results.json``
(everything, per-request data included) and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from chunkserve.bench.args import add_workload_args, workload_from_args
from chunkserve.provenance import git_commit

PEERS = ("llamacpp", "llamacpp-b64", "hf")


@dataclass
class Config:
    name: str
    label: str
    budget: int | None  # None: chunking off or a peer
    command: list[str]
    engine: str = "chunkserve"


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="stall_sweep", help="results folder name")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument(
        "--budgets",
        default="32,64,128,256,512,1024",
        help="comma-separated max_num_batched_tokens values",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip chunking off")
    p.add_argument(
        "--no-defaults",
        action="store_true",
        help="skip the server with no budget flags (the defaults row)",
    )
    p.add_argument(
        "--request-rates",
        default=None,
        help="comma-separated request rates: every config runs the workload at each "
        "(default: --request-rate)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in the folder's results.json (same workload) and run "
        "only the missing configs",
    )
    p.add_argument("--peers", default="", help=f"comma-separated from {PEERS}")
    p.add_argument("--peers-dir", default="benchmarks/peers")
    p.add_argument(
        "--hf-peer-args",
        default="",
        help="extra flags for the HF static peer, e.g. '--device cuda --hf-config DIR'",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="compute threads of every server (1 leaves a core to the client)",
    )
    p.add_argument("--server-args", default="", help="extra flags for chunkserve serve")
    p.add_argument(
        "--itl-slo-ms", default="", help="comma-separated ITL targets: adds --itl-slo-ms servers"
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an extra chunkserve server, e.g. 'limits-off=--max-long-partial-prefills 0' "
        "(repeatable)",
    )
    p.add_argument("--max-duration", type=float, default=1800.0)
    p.add_argument("--goodput", nargs="*", default=["ttft:2000", "itl:200"], metavar="KEY:MS")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="short requests in flight at once (a steady population of users)",
    )
    add_workload_args(p)
    p.set_defaults(request_rate=1.0, num_prompts=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_configs(args: argparse.Namespace) -> list[Config]:
    py = sys.executable
    extra = args.server_args.split() if args.server_args else []
    base = [
        py,
        "-m",
        "chunkserve",
        "serve",
        "--num-threads",
        str(args.threads),
        "--log-level",
        "warning",
        *extra,
    ]
    configs = []
    if not args.no_baseline:
        configs.append(Config("off", "chunking off", None, [*base, "--no-chunked-prefill"]))
    if not args.no_defaults:
        configs.append(Config("defaults", "defaults (no budget flags)", None, base))
    for b in [int(x) for x in args.budgets.split(",") if x.strip()]:
        configs.append(
            Config(
                f"budget-{b}",
                f"chunked, budget {b}",
                b,
                [*base, "--max-num-batched-tokens", str(b)],
            )
        )
    for slo in [x for x in args.itl_slo_ms.split(",") if x.strip()]:
        configs.append(
            Config(f"slo-{slo}ms", f"--itl-slo-ms {slo}", None, [*base, "--itl-slo-ms", slo])
        )
    for spec in args.config:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"config: expected NAME=FLAGS, got {spec!r}")
        configs.append(
            Config(
                name.strip(),
                f"{name.strip()}: {flags.strip() or 'defaults'}",
                None,
                [*base, *flags.split()],
            )
        )
    peers_dir = Path(args.peers_dir)
    for peer in [x for x in args.peers.split(",") if x.strip()]:
        if peer not in PEERS:
            raise ValueError(f"peers: unknown peer {peer!r} (known: {', '.join(PEERS)})")
        if peer.startswith("llamacpp"):
            script = peers_dir / "llamacpp_server.py"
            cmd = [py, str(script), "--threads", str(args.threads)]
            if peer == "llamacpp-b64":
                cmd += ["--n-batch", "64", "--n-ubatch", "64"]
                label = "llama.cpp -b 64 -ub 64"
            else:
                label = "llama.cpp defaults (-b 2048 -ub 512)"
            configs.append(Config(peer, label, None, cmd, engine="llama.cpp"))
        else:
            script = peers_dir / "hf_static_server.py"
            configs.append(
                Config(
                    peer,
                    "HF transformers, static batches of 8",
                    None,
                    [
                        py,
                        str(script),
                        "--threads",
                        str(args.threads),
                        "--batch-size",
                        "8",
                        *args.hf_peer_args.split(),
                    ],
                    engine="transformers",
                )
            )
        if not script.is_file():
            raise ValueError(
                f"peers: {script} not found (run from the repository root or pass --peers-dir)"
            )
    return configs


class ServerProcess:
    def __init__(self, command: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def request_rates(args: argparse.Namespace) -> list[float]:
    if not args.request_rates:
        return [args.request_rate]
    try:
        rates = [float(x) for x in args.request_rates.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"request_rates: expected numbers, got {args.request_rates!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request_rates: must be > 0, got {args.request_rates!r}")
    return rates


def run_sweep(args: argparse.Namespace) -> int:
    from chunkserve.bench.loadgen import GoodputSLO, format_summary, result_document, run
    from chunkserve.bench.report import write_report

    slo = GoodputSLO.parse(args.goodput)
    configs = build_configs(args)
    rates = request_rates(args)
    workloads = {}
    for rate in rates:
        args.request_rate = rate
        workloads[rate] = workload_from_args(args)
    spec = workloads[rates[0]][1]
    out_dir = Path(args.results_dir) / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "commit": git_commit(),
        "command": "chunkserve bench sweep " + " ".join(sys.argv[3:]),
        "threads": args.threads,
        "workload": dict(vars(spec)),
        "request_rates": rates,
        "num_requests": len(workloads[rates[0]][0]),
        "goodput_slo": args.goodput,
    }
    runs: list[dict[str, Any]] = []
    if args.resume:
        wanted = {(c.name, rate) for c in configs for rate in rates}
        runs = resumed_runs(out_dir / "results.json", meta, wanted)
    done = {(r["name"], r.get("request_rate")) for r in runs}
    for rate in rates:
        requests = workloads[rate][0]
        for cfg in configs:
            if (cfg.name, rate) in done:
                print(f"== {cfg.name} at {rate:g} req/s: kept from results.json", flush=True)
                continue
            print(f"== {cfg.name} at {rate:g} req/s: {cfg.label}", flush=True)
            log = out_dir / (f"{cfg.name}.log" if len(rates) == 1 else f"{cfg.name}_{rate:g}.log")
            server = ServerProcess(cfg.command, log)
            try:
                server.wait_healthy()
                records, duration = run(
                    server.base_url + "/v1",
                    requests,
                    endpoint=args.endpoint,
                    max_duration=args.max_duration,
                    max_concurrency=args.max_concurrency,
                    progress=True,
                )
            finally:
                server.stop()
            result = result_document(records, duration, slo)
            print(format_summary(result, f"{cfg.name} at {rate:g} req/s"), flush=True)
            runs.append(
                {
                    "name": cfg.name,
                    "label": cfg.label,
                    "budget": cfg.budget,
                    "engine": cfg.engine,
                    "command": cfg.command,
                    "request_rate": rate,
                    "commit": meta["commit"],
                    **result,
                }
            )
            (out_dir / "results.json").write_text(
                json.dumps({"meta": meta, "runs": runs}, indent=1, default=str)
            )
    write_report(out_dir, meta, runs)
    print(f"wrote {out_dir}/report.md")
    return 0


def resumed_runs(
    path: Path, meta: dict[str, Any], wanted: set[tuple[str, float | None]]
) -> list[dict[str, Any]]:
    """The runs of an earlier, interrupted sweep into the same folder that this sweep would
    repeat, as (config name, request rate); refuses to mix in runs made against a different
    workload (the rate aside). Keeps the earlier date in ``meta`` (the table's rows span
    both) and notes the resume."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())

    def same(workload: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v
            for k, v in json.loads(json.dumps(workload, default=str)).items()
            if k != "request_rate"
        }

    if same(old["meta"].get("workload") or {}) != same(meta["workload"]):
        raise ValueError(f"resume: {path} was made with a different workload")
    meta["date"] = f"{old['meta']['date']} (resumed {meta['date']})"
    return [r for r in old["runs"] if (r["name"], r.get("request_rate")) in wanted]


def machine_description() -> str:
    from chunkserve.provenance import cpu_description

    return f"{cpu_description()}, CPU only"
