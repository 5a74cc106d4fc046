"""gguf-py's ``GGUFReader`` over a plain ndarray view of the file's memory map.

gguf-py keeps the file as an ``np.memmap`` and slices it a few times per metadata value: a
49k-token vocabulary is ~150k values, ~10^6 slices, and every slice of a memmap runs
Python-level ``__getitem__``/``__array_finalize__`` hooks. Parsing the embedded model's
header so cost ~4 s of CPU, in each process that opens the file (a server's front end and
each core). A plain ndarray view of the same map slices in C: ~1.4 s, the same fields and
tensors (tests/test_dequant.py compares). The map stays read-only and alive (the view's
``base``), so tensor data is still read lazily from the file.
"""

from __future__ import annotations

import gguf
import numpy as np


class GGUFReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # gguf-py assigns its np.memmap here first thing; keep a base-class view of it.
        self._data = np.asarray(value)
