"""C kernels compiled on first use with the machine's C compiler, cached by what they were
built from, loaded through ctypes (the CPU attention kernel, the quantized-weight kernels).

Built with ``-march=native`` for the CPU it runs on, so the cache key holds the source, the
compiler, the flags and the CPU's model and flags: a home directory shared between machines
never hands one a library built for another. Kernels thread with OpenMP and link the OpenMP
runtime torch has already loaded (the same ``libgomp``), so their threads are torch's
threads, not a second pool spinning beside them. The library is built in a temporary
directory and moved into place atomically (engine cores and ranks may build at once).

``OnceLoaded`` holds a caller's "tried once" state: the kernel object, or None and the
reason, after which the caller falls back to torch (no compiler, a failed build, not Linux).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

logger = logging.getLogger("chunkserve.cbuild")

# Wall-clock seconds for one compiler run. The quantized kernels take ~21 s of CPU to compile;
# on a machine loaded 10-15 deep that is minutes of wall time, and a build that times out
# falls back to the torch paths (other bits), so the bound is generous.
BUILD_TIMEOUT_S = 600


class OnceLoaded(Generic[T]):
    """A kernel built or taken from the cache once per process: ``get()`` is it, or None
    when ``build`` raised (``error`` says why, logged once as ``unavailable % error``)."""

    def __init__(
        self, build: Callable[[], T], log: logging.Logger, level: int, unavailable: str
    ) -> None:
        self._build, self._log, self._level, self._unavailable = build, log, level, unavailable
        self._lock = threading.Lock()
        self._value: T | None = None
        self.error: str | None = None
        self._tried = False

    def get(self) -> T | None:
        if self._tried:  # set only once the value is (no lock: called on every product)
            return self._value
        with self._lock:
            if not self._tried:
                try:
                    self._value = self._build()
                except Exception as e:  # any build or load failure: the caller's torch path
                    self.error = f"{type(e).__name__}: {e}"
                    self._log.log(self._level, self._unavailable, self.error)
                self._tried = True
            return self._value


def load_library(source: Path, cflags: Sequence[str]) -> tuple[ctypes.CDLL, Path]:
    """The shared library built from ``source`` with ``cflags`` (taken from the cache when
    it was built before from the same inputs) and its path."""
    if platform.system() != "Linux":
        raise RuntimeError("built only on Linux")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc or cc, or $CC)")
    gomp = loaded_openmp()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (source.read_bytes(), compiler.encode(), *(s.encode() for s in version)):
        key.update(part)
    for part in (*cflags, gomp or "-", platform.machine(), _cpu_description()):
        key.update(part.encode())
    path = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _build(compiler, source, cflags, gomp, path)
    return ctypes.CDLL(str(path)), path


def _build(
    compiler: str, source: Path, cflags: Sequence[str], gomp: str | None, path: Path
) -> None:
    """Compile to an object, link it against the OpenMP runtime torch loaded, and move the
    library into place atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / path.name
        _run([compiler, *cflags, "-c", str(source), "-o", str(obj)])
        openmp = [gomp] if gomp else ["-fopenmp"]
        _run([compiler, "-shared", str(obj), "-o", str(lib), *openmp, "-lm"])
        os.replace(lib, path)
    logger.info("built %s: %s", source.name, path)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")


def loaded_openmp() -> str | None:
    """The path of the OpenMP runtime this process has loaded (torch's libgomp), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(maxsplit=1)[-1]
                if "/libgomp" in name and ".so" in name:
                    return name
    except OSError:
        pass
    return None


def _cpu_description() -> str:
    """The CPU's model name and flags (the library is built for them)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("CHUNKSERVE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    directory = base / "chunkserve" / "kernels"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"chunkserve-kernels-{os.getuid()}"
