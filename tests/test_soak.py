"""The short soak CI runs: ``benchmarks/soak.py`` at a small size against its own server.
Correctness only (no timing): every valid request served, every bad one a 4xx naming its
field, no hung request, no KV block held after, the server healthy."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("chunkserve_soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_soak_serves_everything_and_leaks_nothing(tmp_path: Path) -> None:
    soak = load_soak()
    assert len(soak.BAD) >= 30  # distinct bad inputs, each a 4xx naming its field
    status = soak.main(
        [
            # 70 requests with every client plan and every bad kind taken in turn: 30 valid
            # (each of the 10 plans 3 times, beside each other at concurrency 6) and 40 bad
            # (all 34 kinds).
            "--num-requests",
            "70",
            "--cover",
            "--warmup",
            "0",
            "--concurrency",
            "6",
            "--bad-fraction",
            "0.55",
            "--max-tokens",
            "12",
            # Prompts of 20 to 400 characters (the benchmark's 40 to 1,200 a third as long):
            # prefill was most of this test's time, and what it guards (every request served,
            # every bad one refused, nothing hung or held) does not need long prompts.
            "--prompt-chars",
            "20,60,200,400",
            "--request-timeout",
            # Against a hang, not a speed target: on a loaded 2-core machine a request of 12
            # tokens among six streams took over 60 s.
            "300",
            "--server-args",
            "--dtype float32 --max-model-len 512 --kv-cache-memory 64MiB",
            "--out-dir",
            str(tmp_path),
        ]
    )
    doc = json.loads((tmp_path / "soak.json").read_text())
    s, end = doc["soak"], doc["end"]
    assert s["valid_errors"] == 0, s["valid_error_examples"]
    assert s["bad_not_4xx"] == 0, s["bad_examples"]
    assert s["bad_wrong_param"] == 0
    assert s["hung"] == 0
    assert s["bad"] >= len(soak.BAD) and s["valid"] >= 30
    assert s["bad_kinds"] == len(soak.BAD)  # every distinct bad input was sent
    # Every kind of client behaviour happened, aborts at every stage included, each more
    # than once.
    assert set(s["by_plan"]) == set(soak.PLANS) | {"bad"}
    assert min(s["by_plan"].values()) >= 3
    assert {"abort_before_first", "abort_mid_stream", "abort_nonstream", "n2", "stop"} <= set(
        soak.PLANS
    )
    assert end == {"kv_blocks_used": 0, "running": 0, "waiting": 0, "healthy": True}
    assert doc["meta"]["commit"] and "bf16 flags" in doc["meta"]["machine"]
    assert status == 0
    assert (tmp_path / "soak.md").read_text().startswith("# Soak")
