"""A ``chunkserve serve`` subprocess for the API benchmarks (perplexity, tool calls): on a
free loopback port, ready once /health answers, stopped by its PID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("serve exited:\n" + self.proc.stdout.read())
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

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
