"""Report and plots of a sweep: ``report.md`` and PNGs (matplotlib, Agg backend).

A sweep may run its configurations at several request rates: the report has one section per
rate (a table, the targets, the plots). The targets are those of a stall-free default:

- the ``defaults`` server against chunking off: max ITL >= 5x lower, p99 ITL lower, p99.9
  ITL >= 3x lower, output throughput >= 0.95x, median TTFT of short prompts <= 1.1x;
- the ``defaults`` server against the best static budget of the same rate: p99 ITL within
  1.15x, output throughput within 5% (or higher: more is no miss);
- on the ``mix`` workload: defaults no worse than chunking off on every latency percentile
  reported, at equal throughput (within 5%).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

# Latency percentiles compared on the mix workload (key, label).
MIX_PERCENTILES = (
    ("median_ttft_ms", "TTFT p50"),
    ("p90_ttft_ms", "TTFT p90"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p90_itl_ms", "ITL p90"),
    ("p99_itl_ms", "ITL p99"),
    ("p99.9_itl_ms", "ITL p99.9"),
    ("max_itl_ms", "ITL max"),
    ("median_e2el_ms", "E2E p50"),
    ("p99_e2el_ms", "E2E p99"),
)


def _kind(run: dict[str, Any], kind: str, key: str) -> float | None:
    by_kind = run.get("by_kind") or {}
    if kind in by_kind:
        return by_kind[kind].get(key)
    return run.get(key) if kind == "short" else None


def _fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _rate_of(run: dict[str, Any]) -> float | None:
    return run.get("request_rate")


def _rate_label(rate: float | None) -> str:
    return "the sweep's rate" if rate is None else f"{rate:g} req/s"


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
    w = meta["workload"]
    rates = list(dict.fromkeys(_rate_of(r) for r in runs))
    rate_text = (
        ", ".join(f"{r:g}" for r in rates if r is not None) + " req/s"
        if any(r is not None for r in rates)
        else f"{w['request_rate']} req/s"
    )
    lines = [
        f"# Serving sweep: {out_dir.name}",
        "",
        f"Measured {meta['date']} on {meta['machine']}; every server ran with "
        f"{meta['threads']} compute thread(s), the load generator on the same machine"
        + _commits(meta, runs)
        + ".",
        f"Workload: dataset `{w['dataset']}`, {meta['num_requests']} requests "
        f"({w['num_prompts']} {'short ' if w['dataset'] in ('stall', 'fairness') else ''}"
        f"at {rate_text}"
        + (
            f", long documents of {w['long_input'][0]}-{w['long_input'][1]} tokens every "
            f"{w['long_interval']} s"
            if w["dataset"] == "stall"
            else ""
        )
        + f"), seed {w['seed']}, greedy, EOS ignored. Goodput SLO: "
        f"{' '.join(meta['goodput_slo'] or []) or 'none'} (itl = a request's worst gap). "
        "Stalled tokens: inter-token gaps over 3x the run's median gap.",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
    ]
    for rate in rates:
        group = [r for r in runs if _rate_of(r) == rate]
        suffix = "" if len(rates) == 1 else f"_{rate:g}rps"
        if len(rates) > 1:
            lines += [f"## {_rate_label(rate)}", ""]
        lines += [*_table(group), ""]
        lines += [*_targets(group), *_mix_targets(group, w), *_fairness(group, w), ""]
        for title, file in write_plots(out_dir, group, suffix):
            lines += [f"### {title}", "", f"![{title}]({file})", ""]
    (out_dir / "report.md").write_text("\n".join(lines))


def _commits(meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The commit(s) the runs were measured at (a resumed sweep may span two)."""
    commits = list(dict.fromkeys(r.get("commit") or meta.get("commit") for r in runs))
    commits = [c for c in commits if c]
    if len(commits) <= 1:
        return f"; commit {commits[0]}" if commits else ""
    by = {
        c: [f"{r['name']}@{r.get('request_rate')}" for r in runs if r.get("commit") == c]
        for c in commits
    }
    return "; commits " + "; ".join(f"{c} ({', '.join(names)})" for c, names in by.items())


def _classes(runs: list[dict[str, Any]]) -> list[str]:
    """Prompt-length classes present, in a fixed order (stall: short/long; mix: all)."""
    seen = {k for r in runs for k in (r.get("by_kind") or {})} or {"short"}
    return [k for k in ("short", "medium", "long") if k in seen]


def _table(runs: list[dict[str, Any]]) -> list[str]:
    classes = _classes(runs)
    head = (
        "| config | p50 ITL ms | p99 ITL ms | p99.9 ITL ms | max ITL ms | stalled % | "
        + " | ".join(f"median TTFT {c} ms" for c in classes)
        + " | p99 TTFT ms | output tok/s | total tok/s | goodput req/s | failed |"
    )
    out = [head, "|" + "---|" * (11 + len(classes))]
    for r in runs:
        ttfts = " | ".join(_fmt(_kind(r, c, "median_ttft_ms")) for c in classes)
        stalled = r.get("stalled_token_fraction")
        out.append(
            f"| {r['label']} | {_fmt(r['median_itl_ms'])} | {_fmt(r['p99_itl_ms'])} | "
            f"{_fmt(r.get('p99.9_itl_ms'))} | {_fmt(r['max_itl_ms'])} | "
            f"{_fmt(None if stalled is None else 100 * stalled, 2)} | {ttfts} | "
            f"{_fmt(r.get('p99_ttft_ms'))} | {r['output_throughput']:.1f} | "
            f"{r['total_token_throughput']:.0f} | {r.get('request_goodput', 0):.3f} | "
            f"{r['failed']} |"
        )
    return out


def mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _ratio(a: float | None, b: float | None) -> float:
    return (a or 0.0) / max(b or 0.0, 1e-9)


def _targets(runs: list[dict[str, Any]]) -> list[str]:
    off = next((r for r in runs if r["name"] == "off"), None)
    best = pick_best(runs)
    defaults = next((r for r in runs if r["name"] == "defaults"), None)
    out: list[str] = []
    if off is not None and defaults is not None and defaults["completed"]:
        off_ttft = _kind(off, "short", "median_ttft_ms")
        ttft = _kind(defaults, "short", "median_ttft_ms")
        max_gain = _ratio(off["max_itl_ms"], defaults["max_itl_ms"])
        p999_gain = _ratio(off.get("p99.9_itl_ms"), defaults.get("p99.9_itl_ms"))
        tput = _ratio(defaults["output_throughput"], off["output_throughput"])
        ttft_ratio = _ratio(ttft, off_ttft)
        out += [
            "### Defaults against chunking off",
            "",
            f"- max ITL {off['max_itl_ms']:.0f} -> {defaults['max_itl_ms']:.0f} ms: "
            f"{max_gain:.1f}x lower (target >= 5x: {mark(max_gain >= 5)}).",
            f"- p99 ITL {off['p99_itl_ms']:.0f} -> {defaults['p99_itl_ms']:.0f} ms (target "
            f"lower: {mark(defaults['p99_itl_ms'] < off['p99_itl_ms'])}).",
            f"- p99.9 ITL {_fmt(off.get('p99.9_itl_ms'))} -> "
            f"{_fmt(defaults.get('p99.9_itl_ms'))} ms: {p999_gain:.1f}x lower (target >= 3x: "
            f"{mark(p999_gain >= 3)}).",
            f"- output throughput {off['output_throughput']:.1f} -> "
            f"{defaults['output_throughput']:.1f} tok/s: {tput:.3f}x (target >= 0.95x: "
            f"{mark(tput >= 0.95)}).",
            f"- median TTFT of short prompts {_fmt(off_ttft)} -> {_fmt(ttft)} ms: "
            f"{ttft_ratio:.2f}x (target <= 1.1x: {mark(ttft_ratio <= 1.1)}).",
            "",
        ]
    if best is not None and defaults is not None and defaults["completed"]:
        p99 = _ratio(defaults["p99_itl_ms"], best["p99_itl_ms"])
        tput = _ratio(defaults["output_throughput"], best["output_throughput"])
        out += [
            f"### Defaults against the best static budget ({best['label']})",
            "",
            f"- p99 ITL {best['p99_itl_ms']:.0f} -> {defaults['p99_itl_ms']:.0f} ms: "
            f"{p99:.2f}x (target <= 1.15x: {mark(p99 <= 1.15)}).",
            f"- output throughput {best['output_throughput']:.1f} -> "
            f"{defaults['output_throughput']:.1f} tok/s: {tput:.3f}x (target within 5% or "
            f"higher: {mark(tput >= 0.95)}).",
            "",
        ]
    if off is not None and best is not None:
        itl_ratio = _ratio(off["p99_itl_ms"], best["p99_itl_ms"])
        tput_ratio = _ratio(best["output_throughput"], off["output_throughput"])
        off_ttft = _kind(off, "short", "median_ttft_ms") or 0.0
        best_ttft = _kind(best, "short", "median_ttft_ms") or 0.0
        out += [
            f"### The best static budget against chunking off ({best['label']})",
            "",
            "(The targets of the earlier stall sweep, for hand-picked budgets.)",
            "",
            f"- p99 ITL {off['p99_itl_ms']:.0f} -> {best['p99_itl_ms']:.0f} ms: "
            f"{itl_ratio:.1f}x lower (target >= 5x: {mark(itl_ratio >= 5)}).",
            f"- output throughput {off['output_throughput']:.1f} -> "
            f"{best['output_throughput']:.1f} tok/s: {tput_ratio:.2f}x (target >= 0.9x: "
            f"{mark(tput_ratio >= 0.9)}).",
            f"- median TTFT of short requests {off_ttft:.0f} -> {best_ttft:.0f} ms (target: "
            f"better: {mark(best_ttft < off_ttft)}).",
            "",
        ]
    peers = [r for r in runs if r["engine"] == "llama.cpp"]
    if peers and best is not None:
        best_peer_tput = max(r["output_throughput"] for r in peers)
        lowest_peer_itl = min(r["p99_itl_ms"] for r in peers)
        out += [
            "### Against llama.cpp",
            "",
            f"- p99 ITL {best['p99_itl_ms']:.0f} ms vs llama.cpp's best "
            f"{lowest_peer_itl:.0f} ms (target lower: "
            f"{mark(best['p99_itl_ms'] < lowest_peer_itl)}).",
            f"- output throughput {best['output_throughput']:.1f} vs llama.cpp's better "
            f"{best_peer_tput:.1f} tok/s (target at least equal: "
            f"{mark(best['output_throughput'] >= best_peer_tput)}).",
            "",
        ]
    return out


def _mix_targets(runs: list[dict[str, Any]], workload: dict[str, Any]) -> list[str]:
    """Mix workload: the defaults no worse than chunking off on every latency percentile
    (per prompt-length class for TTFT too), at equal throughput."""
    off = next((r for r in runs if r["name"] == "off"), None)
    defaults = next((r for r in runs if r["name"] == "defaults"), None)
    if workload.get("dataset") != "mix" or off is None or defaults is None:
        return []
    rows = [(label, off.get(key), defaults.get(key)) for key, label in MIX_PERCENTILES]
    for c in _classes(runs):
        for key, name in (("median_ttft_ms", "p50"), ("p99_ttft_ms", "p99")):
            rows.append((f"TTFT {c} {name}", _kind(off, c, key), _kind(defaults, c, key)))
    tput = _ratio(defaults["output_throughput"], off["output_throughput"])
    worse = [label for label, a, b in rows if a is not None and b is not None and b > a]
    out = [
        "### Defaults against chunking off, every latency percentile",
        "",
        "| percentile | chunking off ms | defaults ms | defaults / off |",
        "|---|---|---|---|",
    ]
    out += [f"| {label} | {_fmt(a)} | {_fmt(b)} | {_ratio(b, a):.2f} |" for label, a, b in rows]
    out += [
        "",
        f"- output throughput {tput:.3f}x (target within 5%: {mark(abs(tput - 1) <= 0.05)}).",
        f"- no worse on every percentile: {mark(not worse)}"
        + (f" (worse: {', '.join(worse)})." if worse else "."),
        "",
    ]
    return out


def _fairness(runs: list[dict[str, Any]], workload: dict[str, Any]) -> list[str]:
    """Fairness workload: short requests' TTFT of each config against the first."""
    if workload.get("dataset") != "fairness" or len(runs) < 2:
        return []
    ref = runs[0]
    out = ["", f"### Short requests behind long prompts (against {ref['label']})", ""]
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


def write_plots(
    out_dir: Path, runs: list[dict[str, Any]], suffix: str = ""
) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    off = next((r for r in runs if r["name"] == "off"), None)
    best = pick_best(runs)
    defaults = next((r for r in runs if r["name"] == "defaults"), None)
    budget_runs = sorted((r for r in runs if r.get("budget")), key=lambda r: r["budget"])
    shown = [
        (run, color)
        for run, color in ((off, "tab:red"), (defaults, "tab:green"), (best, "tab:blue"))
        if run is not None
    ]

    if off is not None and len(shown) > 1 and "long" in off["kinds"]:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        index = _tracked_request(off)
        for run, color in shown:
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
        ax.set_yscale("log")
        ax.set_title(
            f"Inter-token latency of one short request (#{index}) while long prompts arrive"
        )
        ax.legend(loc="upper right")
        fig.tight_layout()
        name = f"itl_timeline{suffix}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        made.append(("Inter-token latency over time: chunking off, defaults, best budget", name))

    if budget_runs:
        xs = [r["budget"] for r in budget_runs]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for key, style, label in (
            ("p99_itl_ms", "o-", "p99 ITL"),
            ("p99.9_itl_ms", "s--", "p99.9 ITL"),
        ):
            if all(r.get(key) is not None for r in budget_runs):
                a1.plot(xs, [r[key] for r in budget_runs], style, label=f"{label}, static")
        for run, color in ((off, "tab:red"), (defaults, "tab:green")):
            if run is not None:
                a1.axhline(run["p99_itl_ms"], color=color, ls="--", label=f"p99, {run['label']}")
        a1.set_xscale("log", base=2)
        a1.set_yscale("log")
        a1.set_xlabel("max_num_batched_tokens")
        a1.set_ylabel("ms")
        a1.set_title("Inter-token latency tails")
        a1.legend(fontsize=8)
        for kind, color in (
            ("short", "tab:green"),
            ("medium", "tab:orange"),
            ("long", "tab:purple"),
        ):
            ys = [_kind(r, kind, "median_ttft_ms") for r in budget_runs]
            if any(y is not None for y in ys):
                a2.plot(xs, ys, "o-", color=color, label=f"median TTFT {kind}")
                for run, ls in ((off, "--"), (defaults, ":")):
                    if run is not None and _kind(run, kind, "median_ttft_ms") is not None:
                        a2.axhline(
                            _kind(run, kind, "median_ttft_ms"),
                            color=color,
                            ls=ls,
                            label=f"{kind}, {run['label']}",
                        )
        a2.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.set_xlabel("max_num_batched_tokens")
        a2.set_ylabel("ms")
        a2.set_title("Median time to first token")
        a2.legend(fontsize=7)
        fig.tight_layout()
        name = f"latency_vs_budget{suffix}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        made.append(("ITL tails and median TTFT against the budget", name))

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        ax.plot(xs, [r["output_throughput"] for r in budget_runs], "o-", label="static budget")
        styles = iter(["--", ":", "-.", (0, (3, 1, 1, 1))])
        for r in runs:
            if r.get("budget") is None:
                ax.axhline(
                    r["output_throughput"],
                    ls=next(styles, "--"),
                    lw=1,
                    color={"off": "tab:red", "defaults": "tab:green"}.get(r["name"]),
                    label=r["label"],
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Output throughput")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"throughput_vs_budget{suffix}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        made.append(("Output throughput against the budget", name))
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
