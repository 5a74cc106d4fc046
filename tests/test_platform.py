"""Platform helpers: giving the C heap's free pages back to the system after loading."""

from __future__ import annotations

import ctypes
import platform

import pytest

from chunkserve.memory import release_free_heap


def _glibc():
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


@pytest.mark.skipif(_glibc() is None, reason="needs glibc")
def test_freed_heap_in_the_middle_goes_back_to_the_system() -> None:
    """Small blocks freed under a block still in use stay resident (glibc trims only the
    heap's top by itself) until ``release_free_heap``."""
    libc = _glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 8 << 10, 16_000  # 125 MiB in blocks under the mmap threshold
    blocks = [libc.malloc(size) for _ in range(count)]
    try:
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks[:-1]:  # the last one pins the heap's top
            libc.free(b)
        released = release_free_heap()
        assert released > 64 << 20, f"released {released} bytes"
        assert release_free_heap() < 8 << 20  # nothing left to give
    finally:
        libc.free(blocks[-1])


def test_release_never_raises() -> None:
    assert release_free_heap() >= 0
