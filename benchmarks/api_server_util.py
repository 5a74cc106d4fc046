"""A ``chunkserve serve`` subprocess for the API benchmarks (perplexity, tool calls): on a
free loopback port, ready once /health answers, stopped by its PID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


class ServeProcess:
    def __init__(self, *args: str, timeout_s: float = 900) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "chunkserve", "serve", "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        # Its output to a file: a pipe nobody reads would stall the server once full.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="chunkserve-", suffix=".log")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError("serve exited:\n" + self.log.read())
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("serve did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
