"""Where a result was measured: the machine (CPU model, cores, bf16 flags) and the commit.
Torch-free, so the load generator can use it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_description() -> str:
    """``x86_64 AMD EPYC, 2 cores, bf16 flags: avx512_bf16``: what benchmark results and
    profiles say they ran on (the bf16 flags decide ``dtype auto`` and the matmul speed)."""
    name = platform.processor() or "unknown CPU"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == (platform.processor() or "unknown CPU"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split() if "bf16" in f]
    except OSError:
        pass
    bf16 = ", ".join(flags) if flags else "none"
    return f"{platform.machine()} {name}, {os.cpu_count()} cores, bf16 flags: {bf16}"


def git_commit() -> str | None:
    """The commit of the working directory's checkout (with ``+dirty`` for uncommitted
    changes outside ``benchmarks/results``: results an earlier run wrote are not code), which
    every benchmark result records; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!benchmarks/results",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None
