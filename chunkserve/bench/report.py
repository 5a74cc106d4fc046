"""Report and plots of a sweep: ``report.md`` and three PNGs (matplotlib, Agg backend)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any


def _kind(run: dict[str, Any], kind: str, key: str) -> float | None:
    by_kind = run.get("by_kind") or {}
    if kind in by_kind:
        return by_kind[kind].get(key)
    return run.get(key) if kind == "short" else None


def _fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def pick_best(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The static-budget run that meets the most of the three targets against chunking off
    (p99 ITL at most 1/5, output throughput at least 0.9x, lower median short TTFT), then
    the lowest p99 ITL."""
    off = next((r for r in runs if r["name"] == "off"), None)
    chunked = [r for r in runs if r.get("budget") and r["completed"]]
    if not chunked:
        return None
    if off is None:
        return min(chunked, key=lambda r: r["p99_itl_ms"])
    off_ttft = _kind(off, "short", "median_ttft_ms") or 0.0

    def score(r: dict[str, Any]) -> tuple[int, float]:
        met = (
            (r["p99_itl_ms"] * 5 <= off["p99_itl_ms"])
            + (r["output_throughput"] >= 0.9 * off["output_throughput"])
            + ((_kind(r, "short", "median_ttft_ms") or 0.0) < off_ttft)
        )
        return (-met, r["p99_itl_ms"])

    return min(chunked, key=score)


def write_report(out_dir: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    plots = write_plots(out_dir, runs)
    w = meta["workload"]
    lines = [
        f"# Serving sweep: {out_dir.name}",
        "",
        f"Measured {meta['date']} on {meta['machine']}; every server ran with "
        f"{meta['threads']} compute thread(s), the load generator on the same machine.",
        f"Workload: dataset `{w['dataset']}`, {meta['num_requests']} requests "
        f"({w['num_prompts']} short at {w['request_rate']} req/s"
        + (
            f", long documents of {w['long_input'][0]}-{w['long_input'][1]} tokens every "
            f"{w['long_interval']} s"
            if w["dataset"] == "stall"
            else ""
        )
        + f"), seed {w['seed']}, greedy, EOS ignored. Goodput SLO: "
        f"{' '.join(meta['goodput_slo'] or []) or 'none'} (itl = a request's worst gap).",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
        "| config | p50 ITL ms | p99 ITL ms | max ITL ms | median TTFT short ms | "
        "p99 TTFT short ms | median TTFT long ms | output tok/s | total tok/s | "
        "goodput req/s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['label']} | {_fmt(r['median_itl_ms'])} | {_fmt(r['p99_itl_ms'])} | "
            f"{_fmt(r['max_itl_ms'])} | {_fmt(_kind(r, 'short', 'median_ttft_ms'))} | "
            f"{_fmt(_kind(r, 'short', 'p99_ttft_ms'))} | "
            f"{_fmt(_kind(r, 'long', 'median_ttft_ms'))} | {r['output_throughput']:.1f} | "
            f"{r['total_token_throughput']:.0f} | {r.get('request_goodput', 0):.3f} | "
            f"{r['failed']} |"
        )
    lines += ["", *_targets(runs), *_fairness(runs, w), ""]
    for title, file in plots:
        lines += [f"## {title}", "", f"![{title}]({file})", ""]
    (out_dir / "report.md").write_text("\n".join(lines))


def mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _targets(runs: list[dict[str, Any]]) -> list[str]:
    off = next((r for r in runs if r["name"] == "off"), None)
    best = pick_best(runs)
    if off is None or best is None:
        return []
    itl_ratio = off["p99_itl_ms"] / max(best["p99_itl_ms"], 1e-9)
    tput_ratio = best["output_throughput"] / max(off["output_throughput"], 1e-9)
    off_ttft = _kind(off, "short", "median_ttft_ms") or 0.0
    best_ttft = _kind(best, "short", "median_ttft_ms") or 0.0

    out = [
        f"## Against chunking off (best budget: {best['label']})",
        "",
        f"- p99 ITL {off['p99_itl_ms']:.0f} -> {best['p99_itl_ms']:.0f} ms: {itl_ratio:.1f}x "
        f"lower (target >= 5x: {mark(itl_ratio >= 5)}).",
        f"- output throughput {off['output_throughput']:.1f} -> "
        f"{best['output_throughput']:.1f} tok/s: {tput_ratio:.2f}x (target >= 0.9x: "
        f"{mark(tput_ratio >= 0.9)}).",
        f"- median TTFT of short requests {off_ttft:.0f} -> {best_ttft:.0f} ms (target: "
        f"better: {mark(best_ttft < off_ttft)}).",
    ]
    peers = [r for r in runs if r["engine"] == "llama.cpp"]
    if peers:
        best_peer_tput = max(r["output_throughput"] for r in peers)
        lowest_peer_itl = min(r["p99_itl_ms"] for r in peers)
        out += [
            "",
            "## Against llama.cpp",
            "",
            f"- p99 ITL {best['p99_itl_ms']:.0f} ms vs llama.cpp's best "
            f"{lowest_peer_itl:.0f} ms (target lower: "
            f"{mark(best['p99_itl_ms'] < lowest_peer_itl)}).",
            f"- output throughput {best['output_throughput']:.1f} vs llama.cpp's better "
            f"{best_peer_tput:.1f} tok/s (target at least equal: "
            f"{mark(best['output_throughput'] >= best_peer_tput)}).",
        ]
    return out


def _fairness(runs: list[dict[str, Any]], workload: dict[str, Any]) -> list[str]:
    """Fairness workload: short requests' TTFT of each config against the first."""
    if workload.get("dataset") != "fairness" or len(runs) < 2:
        return []
    ref = runs[0]
    out = ["", f"## Short requests behind long prompts (against {ref['label']})", ""]
    ref_ttft = _kind(ref, "short", "median_ttft_ms") or 0.0
    for r in runs[1:]:
        ttft = _kind(r, "short", "median_ttft_ms") or 0.0
        p99 = _kind(r, "short", "p99_ttft_ms") or 0.0
        tput = r["total_token_throughput"] / max(ref["total_token_throughput"], 1e-9)
        gain = ref_ttft / max(ttft, 1e-9)
        out.append(
            f"- {r['label']}: median short TTFT {ttft:.0f} ms vs {ref_ttft:.0f} ms "
            f"({gain:.1f}x better; target >= 3x: {mark(gain >= 3)}), p99 {p99:.0f} ms vs "
            f"{_kind(ref, 'short', 'p99_ttft_ms') or 0:.0f} ms; total throughput {tput:.3f}x "
            f"(target >= 0.9x: {mark(tput >= 0.9)})."
        )
    return out


def write_plots(out_dir: Path, runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    off = next((r for r in runs if r["name"] == "off"), None)
    best = pick_best(runs)
    budget_runs = sorted((r for r in runs if r.get("budget")), key=lambda r: r["budget"])

    if off is not None and best is not None:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        index = _tracked_request(off)
        for run, color in ((off, "tab:red"), (best, "tab:blue")):
            t = run["chunk_times"][index]
            gaps = [1e3 * (b - a) for a, b in itertools.pairwise(t)]
            # Each token's gap drawn over the time it took: a stall is a long plateau.
            ax.hlines(gaps, t[:-1], t[1:], color=color, lw=1.6, label=run["label"])
            ax.plot(t[1:], gaps, ".", color=color, ms=3)
        for i, (kind, arr) in enumerate(zip(off["kinds"], off["arrivals"])):
            if kind == "long":
                ax.axvline(
                    arr,
                    color="grey",
                    ls="--",
                    lw=0.8,
                    label="long prompt arrives" if i == off["kinds"].index("long") else None,
                )
        t_off = off["chunk_times"][index]
        if t_off:
            ax.set_xlim(max(0.0, t_off[0] - 2), t_off[-1] + 2)
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("time to this token (ms)")
        ax.set_title(
            f"Inter-token latency of one short request (#{index}) while long prompts arrive"
        )
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out_dir / "itl_timeline.png", dpi=110)
        plt.close(fig)
        made.append(("Inter-token latency over time, chunking off vs on", "itl_timeline.png"))

    if budget_runs:
        xs = [r["budget"] for r in budget_runs]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        a1.plot(xs, [r["p99_itl_ms"] for r in budget_runs], "o-", label="p99 ITL, chunked")
        if off is not None:
            a1.axhline(off["p99_itl_ms"], color="tab:red", ls="--", label="p99 ITL, off")
        a1.set_xscale("log", base=2)
        a1.set_xlabel("max_num_batched_tokens")
        a1.set_ylabel("ms")
        a1.set_title("p99 inter-token latency")
        a1.legend()
        for kind, color in (("short", "tab:green"), ("long", "tab:purple")):
            ys = [_kind(r, kind, "median_ttft_ms") for r in budget_runs]
            if any(y is not None for y in ys):
                a2.plot(xs, ys, "o-", color=color, label=f"median TTFT {kind}")
                if off is not None and _kind(off, kind, "median_ttft_ms") is not None:
                    a2.axhline(
                        _kind(off, kind, "median_ttft_ms"),
                        color=color,
                        ls="--",
                        label=f"{kind}, off",
                    )
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("max_num_batched_tokens")
        a2.set_ylabel("ms")
        a2.set_title("Median time to first token")
        a2.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "latency_vs_budget.png", dpi=110)
        plt.close(fig)
        made.append(("p99 ITL and median TTFT against the budget", "latency_vs_budget.png"))

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ax.plot(xs, [r["output_throughput"] for r in budget_runs], "o-", label="chunked")
        styles = iter(["--", ":", "-.", (0, (3, 1, 1, 1))])
        for r in runs:
            if r.get("budget") is None:
                ax.axhline(
                    r["output_throughput"],
                    ls=next(styles, "--"),
                    lw=1,
                    color="tab:red" if r["name"] == "off" else None,
                    label=r["label"],
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Output throughput")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_budget.png", dpi=110)
        plt.close(fig)
        made.append(("Output throughput against the budget", "throughput_vs_budget.png"))
    return made


def _tracked_request(run: dict[str, Any]) -> int:
    """A short request that was decoding when a long prompt arrived (the most chunks
    among those), so its stall shows."""
    longs = [a for k, a in zip(run["kinds"], run["arrivals"]) if k == "long"]
    best, best_n = 0, -1
    for i, (kind, times) in enumerate(zip(run["kinds"], run["chunk_times"])):
        if kind == "long" or len(times) < 2:
            continue
        covers = any(times[0] < a < times[-1] for a in longs)
        n = len(times) + (10_000 if covers else 0)
        if n > best_n:
            best, best_n = i, n
    return best
