"""Benchmark tooling: workloads, metrics, the sweep report, and the profile / tune /
simulate / bench serve commands end to end (small sizes)."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from chunkserve.bench.datasets import WorkloadSpec, arrival_times, build_workload
from chunkserve.bench.loadgen import (
    GoodputSLO,
    RequestRecord,
    percentile,
    stalled_fraction,
    summarize,
)
from chunkserve.bench.report import pick_best, write_report
from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.entrypoints.cli import main
from chunkserve.model.loader import embedded_model_path, open_gguf
from tests.test_server import Server


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    path = embedded_model_path()
    return Tokenizer.from_gguf(path, open_gguf(path))


def test_stall_workload_shape(tok: Tokenizer) -> None:
    spec = WorkloadSpec(dataset="stall", num_prompts=40, request_rate=2.0, long_interval=5.0)
    reqs = build_workload(spec, tok)
    shorts = [r for r in reqs if r.kind == "short"]
    longs = [r for r in reqs if r.kind == "long"]
    assert len(shorts) == 40 and len(longs) >= 3
    assert all(20 <= r.prompt_len <= 60 and 90 <= r.output_len <= 110 for r in shorts)
    assert all(1500 <= r.prompt_len <= 4000 for r in longs)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    # Real prose, not repeated words.
    text = tok.decode(longs[0].prompt)
    words = text.split()
    assert len(set(words)) > 0.3 * len(words)
    assert build_workload(spec, tok)[5].prompt == reqs[5].prompt  # seeded


def test_fairness_and_random_workloads(tok: Tokenizer) -> None:
    reqs = build_workload(WorkloadSpec(dataset="fairness", num_prompts=10, request_rate=1.0), tok)
    longs = [r for r in reqs if r.kind == "long"]
    assert len(longs) == 8 and all(r.prompt_len >= 4000 and r.arrival == 0 for r in longs)
    assert all(r.arrival > 0 for r in reqs if r.kind == "short")
    rand = build_workload(
        WorkloadSpec(dataset="random", num_prompts=5, input_len=100, output_len=7), tok
    )
    assert all(r.prompt_len == 100 and r.output_len == 7 for r in rand)


def test_mix_workload_spreads_lengths_into_classes(tok: Tokenizer) -> None:
    reqs = build_workload(WorkloadSpec(dataset="mix", num_prompts=400, request_rate=2.0), tok)
    lens = sorted(r.prompt_len for r in reqs)
    assert 200 <= lens[len(lens) // 2] <= 420  # median ~300
    assert lens[0] >= 16 and lens[-1] <= 6000 and lens[int(0.95 * len(lens))] > 1024
    outs = sorted(r.output_len for r in reqs)
    assert 70 <= outs[len(outs) // 2] <= 140 and outs[0] >= 8 and outs[-1] <= 800
    for r in reqs:
        want = "short" if r.prompt_len < 256 else "medium" if r.prompt_len < 1024 else "long"
        assert r.kind == want
    assert {r.kind for r in reqs} == {"short", "medium", "long"}
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(reqs)]
    assert abs(statistics.fmean(gaps) - 0.5) < 0.1


def test_sharegpt_from_local_file(tok: Tokenizer, tmp_path: Path) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about topic {i}, please."},
                {"from": "gpt", "value": "Sure. " * (10 + i)},
            ]
        }
        for i in range(5)
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = build_workload(
        WorkloadSpec(dataset="sharegpt", num_prompts=8, dataset_path=str(path)), tok
    )
    assert len(reqs) == 8 and all(r.output_len >= 10 for r in reqs)
    with pytest.raises(ValueError, match="dataset_path"):
        build_workload(WorkloadSpec(dataset="sharegpt", dataset_path=str(tmp_path / "no")), tok)


def test_arrival_processes() -> None:
    rng = random.Random(0)
    t = arrival_times(4000, 5.0, 1.0, rng)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert abs(statistics.fmean(gaps) - 0.2) < 0.01
    bursty = arrival_times(4000, 5.0, 0.3, random.Random(0))
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert abs(statistics.fmean(bgaps) - 0.2) < 0.02
    assert statistics.pstdev(bgaps) > 1.5 * statistics.pstdev(gaps)  # gamma < 1: burstier
    assert arrival_times(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]


def test_summary_metrics_and_goodput() -> None:
    recs = []
    for i in range(10):
        r = RequestRecord(i, "short", 10, 0.0, start=0.0, ttft=0.1 * (i + 1))
        r.chunk_times = [0.1 * (i + 1) + 0.05 * k for k in range(5)]
        if i == 9:
            r.chunk_times[-1] += 2.0  # one stall
        r.end = r.chunk_times[-1]
        r.output_tokens = 5
        r.success = True
        recs.append(r)
    res = summarize(recs, 10.0, GoodputSLO.parse(["ttft:500", "itl:100"]))
    assert res["completed"] == 10 and res["total_output_tokens"] == 50
    assert res["median_ttft_ms"] == pytest.approx(550.0)
    assert res["max_itl_ms"] == pytest.approx(2050.0)
    assert res["request_goodput"] == pytest.approx(0.5)  # ttft <= 500 ms for 5, none stalled
    # 40 gaps of 50 ms, one of 2,050 ms: the one stalled token, and the tail percentile
    assert res["stalled_token_fraction"] == pytest.approx(1 / 40)
    assert res["p99.9_itl_ms"] == pytest.approx(50 + 0.961 * 2000, rel=1e-3)
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert stalled_fraction([0.1] * 9 + [0.29]) == 0.0
    assert stalled_fraction([0.1] * 9 + [0.31]) == pytest.approx(0.1)
    assert stalled_fraction([]) == 0.0
    with pytest.raises(ValueError, match="goodput"):
        GoodputSLO.parse(["latency:5"])


def _fake_run(name: str, budget, p99: float, tput: float, ttft: float, rate=None) -> dict:
    return {
        "name": name,
        "label": name,
        "budget": budget,
        "engine": "chunkserve",
        "request_rate": rate,
        "completed": 3,
        "failed": 0,
        "median_itl_ms": 50.0,
        "p99_itl_ms": p99,
        "p99.9_itl_ms": 1.5 * p99,
        "max_itl_ms": 2 * p99,
        "stalled_token_fraction": 0.01,
        "output_throughput": tput,
        "total_token_throughput": 10 * tput,
        "request_goodput": 0.1,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "by_kind": {},
        "kinds": ["short", "long", "short"],
        "arrivals": [0.0, 1.0, 0.5],
        "chunk_times": [[0.1, 0.2, 2.5, 2.6], [1.5, 1.6], [0.6, 0.7, 0.8]],
        "itls": [[], [], []],
    }


def _meta(dataset: str = "stall", **extra) -> dict:
    """A sweep's metadata as ``write_report`` reads it (``extra`` adds or replaces keys)."""
    return {
        "date": "today",
        "machine": "test",
        "command": "x",
        "threads": 1,
        "workload": vars(WorkloadSpec(dataset=dataset)),
        "num_requests": 3,
        "goodput_slo": [],
        **extra,
    }


def test_report_and_best_budget(tmp_path: Path) -> None:
    runs = [
        _fake_run("off", None, 2000.0, 80.0, 300.0),
        _fake_run("budget-64", 64, 200.0, 70.0, 400.0),
        _fake_run("budget-128", 128, 300.0, 79.0, 250.0),
        _fake_run("budget-512", 512, 900.0, 80.0, 200.0),
    ]
    assert pick_best(runs)["name"] == "budget-128"  # meets all three targets
    meta = {
        "date": "today",
        "machine": "test",
        "command": "x",
        "threads": 1,
        "workload": {
            "dataset": "stall",
            "num_prompts": 2,
            "request_rate": 1.0,
            "long_input": [1500, 4000],
            "long_interval": 5.0,
            "seed": 0,
        },
        "num_requests": 3,
        "goodput_slo": ["ttft:1000"],
    }
    write_report(tmp_path, meta, runs)
    report = (tmp_path / "report.md").read_text()
    assert "6.7x lower" in report and "budget-128" in report
    for png in ("itl_timeline.png", "latency_vs_budget.png", "throughput_vs_budget.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_report_per_rate_judges_the_defaults(tmp_path: Path) -> None:
    """Two rates: a section each, the defaults judged against chunking off and the best
    static budget of the same rate."""
    runs = []
    for rate, scale in ((0.5, 1.0), (1.0, 2.0)):
        runs += [
            _fake_run("off", None, 2000.0 * scale, 80.0, 300.0, rate),
            _fake_run("defaults", None, 150.0 * scale, 79.0, 310.0, rate),
            _fake_run("budget-64", 64, 140.0 * scale, 78.0, 320.0, rate),
        ]
    runs[4]["output_throughput"] = 70.0  # 1.0 req/s: the defaults lose 12.5%
    meta = _meta(commit="abc1234")
    write_report(tmp_path, meta, runs)
    report = (tmp_path / "report.md").read_text()
    assert "## 0.5 req/s" in report and "## 1 req/s" in report and "commit abc1234" in report
    half, full = report.split("## 1 req/s")
    assert "max ITL 4000 -> 300 ms: 13.3x lower (target >= 5x: met)" in half
    assert "p99.9 ITL 3000 -> 225 ms: 13.3x lower (target >= 3x: met)" in half
    assert "median TTFT of short prompts 300 -> 310 ms: 1.03x (target <= 1.1x: met)" in half
    assert "p99 ITL 140 -> 150 ms: 1.07x (target <= 1.15x: met)" in half
    assert "80.0 -> 70.0 tok/s: 0.875x (target >= 0.95x: NOT met)" in full
    assert (tmp_path / "itl_timeline_0.5rps.png").stat().st_size > 1000
    assert (tmp_path / "latency_vs_budget_1rps.png").stat().st_size > 1000


def test_defaults_faster_than_the_best_budget_is_no_miss(tmp_path: Path) -> None:
    """ "Throughput within 5% of the best static budget" bounds a loss: more is met."""
    runs = [
        _fake_run("off", None, 2000.0, 80.0, 300.0),
        _fake_run("defaults", None, 150.0, 80.0, 310.0),
        _fake_run("budget-32", 32, 140.0, 72.0, 320.0),
    ]
    meta = _meta()
    write_report(tmp_path, meta, runs)
    report = (tmp_path / "report.md").read_text()
    assert "72.0 -> 80.0 tok/s: 1.111x (target within 5% or higher: met)" in report
    runs[1]["output_throughput"] = 68.0
    write_report(tmp_path, meta, runs)
    report = (tmp_path / "report.md").read_text()
    assert "72.0 -> 68.0 tok/s: 0.944x (target within 5% or higher: NOT met)" in report


def test_mix_report_compares_every_percentile(tmp_path: Path) -> None:
    off = _fake_run("off", None, 900.0, 60.0, 300.0)
    defaults = _fake_run("defaults", None, 200.0, 59.5, 350.0)
    for run, ttft in ((off, 300.0), (defaults, 350.0)):
        run["by_kind"] = {
            k: {"median_ttft_ms": ttft * f, "p99_ttft_ms": 3 * ttft * f}
            for k, f in (("short", 0.5), ("medium", 1.0), ("long", 4.0))
        }
    write_report(tmp_path, _meta("mix"), [off, defaults])
    report = (tmp_path / "report.md").read_text()
    assert "| ITL p99 | 900 | 200 | 0.22 |" in report
    assert "| TTFT medium p50 | 300 | 350 | 1.17 |" in report
    assert "no worse on every percentile: NOT met (worse: TTFT p50" in report
    assert "median TTFT medium ms" in report  # the table has a column per class


def test_fairness_report_marks_its_targets(tmp_path: Path) -> None:
    off = _fake_run("limits-off", None, 900.0, 60.0, 0.0)
    on = _fake_run("limits-on", None, 1400.0, 53.0, 0.0)
    off["by_kind"] = {"short": {"median_ttft_ms": 30000.0, "p99_ttft_ms": 50000.0}}
    on["by_kind"] = {"short": {"median_ttft_ms": 1000.0, "p99_ttft_ms": 2000.0}}
    write_report(tmp_path, _meta("fairness"), [off, on])
    report = (tmp_path / "report.md").read_text()
    assert "30.0x better; target >= 3x: met" in report
    assert "total throughput 0.883x (target >= 0.9x: NOT met)" in report


def test_sweep_resume_keeps_matching_runs(tmp_path: Path) -> None:
    from chunkserve.bench.sweep import resumed_runs

    workload = {"dataset": "stall", "long_input": (1500, 4000), "seed": 0, "request_rate": 1.0}
    old_meta = {"date": "monday", "workload": json.loads(json.dumps(workload))}
    runs = [
        {"name": "off", "request_rate": 1.0},
        {"name": "off", "request_rate": 2.0},
        {"name": "budget-64", "request_rate": 1.0},
        {"name": "dropped", "request_rate": 1.0},
    ]
    path = tmp_path / "results.json"
    assert resumed_runs(path, {"date": "tuesday", "workload": workload}, {("off", 1.0)}) == []
    path.write_text(json.dumps({"meta": old_meta, "runs": runs}))
    meta = {"date": "tuesday", "workload": {**workload, "request_rate": 2.0}}
    wanted = {("off", 1.0), ("off", 2.0), ("budget-64", 1.0), ("budget-128", 1.0)}
    kept = resumed_runs(path, meta, wanted)
    assert [(r["name"], r["request_rate"]) for r in kept] == [
        ("off", 1.0),
        ("off", 2.0),
        ("budget-64", 1.0),
    ]
    assert meta["date"] == "monday (resumed tuesday)"
    with pytest.raises(ValueError, match="different workload"):
        resumed_runs(path, {"date": "x", "workload": {**workload, "seed": 1}}, {("off", 1.0)})


def test_sweep_configs_and_rates() -> None:
    import argparse

    from chunkserve.bench.sweep import add_sweep_args, build_configs, request_rates

    p = argparse.ArgumentParser()
    add_sweep_args(p)
    args = p.parse_args(["--budgets", "64,128", "--request-rates", "0.5,1"])
    names = [c.name for c in build_configs(args)]
    assert names == ["off", "defaults", "budget-64", "budget-128"]
    defaults = build_configs(args)[1].command
    assert not {"--max-num-batched-tokens", "--itl-slo-ms", "--no-chunked-prefill"} & set(defaults)
    assert request_rates(args) == [0.5, 1.0]
    assert request_rates(p.parse_args(["--request-rate", "3"])) == [3.0]
    for bad in ("0.5,x", "0,1", ","):
        with pytest.raises(ValueError, match="request_rates"):
            request_rates(p.parse_args(["--request-rates", bad]))
    assert "defaults" not in [c.name for c in build_configs(p.parse_args(["--no-defaults"]))]


def test_profile_tune_simulate_commands(tmp_path: Path, hf_dir: Path, capsys) -> None:
    from tests.test_model_families import hf_config, write_model

    # A tiny random Llama (2 layers, width 64): the commands end to end (the grid, the fit,
    # the saved profile, tune and simulate reading it) do not need the embedded model's
    # 30 layers, whose steps were most of this test's time.
    tiny = write_model(tmp_path / "tiny", hf_config("llama", tie_word_embeddings=True), hf_dir)
    profile = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(tiny),
                "--quick",
                "--dtype",
                "float32",
                "--repeats",
                "1",
                "--max-model-len",
                "1024",
                "--output",
                str(profile),
            ]
        )
        == 0
    )
    doc = json.loads(profile.read_text())
    assert doc["features"][-2:] == ["decode_padded_k", "experts_touched"]
    assert len(doc["weights"]) == 10 and doc["weights"][-1] == 0.0  # a dense model
    assert "routing" not in doc
    assert doc["fit"]["num_shapes"] >= 10
    # Prefill-only shapes are measured with and without sampling (the LM head), so the fit
    # can tell that cost apart; steps with decodes always sample.
    prefill_only = [s for s in doc["samples"] if not s["decode_context_lens"]]
    assert {s.get("prefill_samples", 0) for s in prefill_only} == {0, 1}
    # Steps with one long decode among short ones (the padded-keys term needs them).
    assert any(len(set(s["decode_context_lens"])) > 1 for s in doc["samples"])
    assert doc["dtype"] == "float32" and "heldout_mean_rel_error" in doc["fit"]
    capsys.readouterr()
    # Both outcomes of tune, whatever this machine's speed: a target no step can miss gets
    # a recommendation, one no step can meet gets none.
    tune = ["tune", "--cost-profile", str(profile), "--num-decodes", "4", "--itl-slo-ms"]
    main([*tune, "100000"])
    out = capsys.readouterr().out
    assert "predicted ITL ms" in out and "recommended" in out and "no static budget" not in out
    main([*tune, "0.001"])
    out = capsys.readouterr().out
    assert "no static budget meets it" in out
    result = tmp_path / "sim.json"
    assert (
        main(
            [
                "simulate",
                "--cost-profile",
                str(profile),
                "--dataset",
                "stall",
                "--num-prompts",
                "12",
                "--request-rate",
                "2",
                "--max-num-batched-tokens",
                "64",
                "--result-json",
                str(result),
            ]
        )
        == 0
    )
    sim = json.loads(result.read_text())
    assert sim["simulated"] and sim["completed"] == len(sim["input_lens"]) and sim["failed"] == 0
    assert "short" in sim["by_kind"] and "long" in sim["by_kind"]


def test_bench_serve_against_a_server(tmp_path: Path) -> None:
    server = Server()
    try:
        out = tmp_path / "r.json"
        assert (
            main(
                [
                    "bench",
                    "serve",
                    "--base-url",
                    server.base + "/v1",
                    "--dataset",
                    "random",
                    "--num-prompts",
                    "4",
                    "--input-len",
                    "20",
                    "--output-len",
                    "6",
                    "--result-json",
                    str(out),
                    "--no-progress",
                    "--goodput",
                    "ttft:60000",
                ]
            )
            == 0
        )
        res = json.loads(out.read_text())
        assert res["completed"] == 4 and res["total_output_tokens"] == 24
        for key in (
            "mean_ttft_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "p99_itl_ms",
            "mean_e2el_ms",
            "request_throughput",
            "output_throughput",
            "request_goodput",
            "max_itl_ms",
            "ttfts",
            "itls",
        ):
            assert key in res
    finally:
        server.stop()
