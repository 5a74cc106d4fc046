"""Weights kept in their quantized bits, behind one protocol the model's layers call.

A ``QuantizedWeight`` is an [out_features, in_features] weight (HF's [out, in]) that never
exists in full as floats: ``matmul`` multiplies by it, ``embedding`` dequantizes only the
rows asked for, and the edits loading needs (row ranges for tensor-parallel shards and fused
parts, column ranges at block boundaries, llama.cpp's Q/K row permutation, concatenation of
parts) happen on the quantized bits. Every edit returns a new weight owning its own bytes,
so a shard never keeps the whole tensor alive.

``GGUFWeight`` holds GGML block rows as the file stores them (uint8 [out, row_bytes], a row
being ``in / block_values`` blocks); ``formats`` describes each format. ``matmul`` runs the
C kernels of ``kernels`` when they are built, else the reference here: dequantize (bit for
bit as gguf-py) to float32, cast to x's dtype, ``F.linear``: the very arithmetic of a model
dequantized at load, so the two agree exactly. The file's block layout is kept through the
load, so the edits above stay byte copies; at the end of the load (``prepare``, for a bf16
CPU engine) or at its first int8-activation product, a Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weight
of a multiple of 16 rows is repacked (``pack``: the same bytes reordered so the batch-1
kernel loads its operands as they lie, ~2-3x faster per product here; the same bits on every
path), after which ``data`` unpacks a copy of the file's rows where something asks for them.
``CHUNKSERVE_QUANT_PACK=0`` keeps the file's layout.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from chunkserve.quant import formats, kernels

# Inputs a product takes (``QuantizedWeight._check_x``).
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The reference dequantizes at most this many values at a time (64 MiB of float32), so a
# large tied embedding used as the head never exists in full as floats.
REFERENCE_TILE_VALUES = 1 << 24


class QuantizedWeight(abc.ABC):
    """An [out, in] weight kept quantized. Invariants: ``shape`` is (out_features,
    in_features); ``matmul(x)`` equals ``x @ dequantize(x.dtype).T`` within the kernel's
    stated tolerance; every edit (``rows``, ``cols``, ``permute_rows``) returns a new weight
    of the same class and qtype owning its own storage (but ``permute_rows`` of a GGUF
    weight over a file's map, which stays a view until ``rows``, ``cols`` or ``owned``
    copy from it)."""

    qtype: str
    shape: tuple[int, int]
    name: str

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (bf16 or fp32) -> [..., out] in x's dtype."""

    def row_invariant(self, x: torch.Tensor) -> bool:
        """Whether ``matmul_row_invariant(x)`` can compute each row's result from that row
        alone with the same arithmetic whatever the number of rows and threads (then the
        deterministic mode's row tiling is not needed for this weight)."""
        return False

    def matmul_row_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """``matmul(x)`` with each row computed the same way whatever the rows beside it
        (only where ``row_invariant(x)``)."""
        raise NotImplementedError(f"{type(self).__name__} has no row-invariant matmul")

    def set_invariant_kernel(self, name: str) -> bool:
        """The kernel ``matmul_row_invariant`` runs (``EngineConfig.deterministic_quant_kernel``:
        "int8" or "bf16"); whether this weight has a choice (this one: none, its products
        run on the deterministic mode's row tiles)."""
        return False

    @abc.abstractmethod
    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape of int64) dequantized: [*ids.shape, in] in ``dtype``."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as floats, [out, in]."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Resident bytes (everything this weight keeps alive)."""

    @abc.abstractmethod
    def rows(self, first: int, end: int) -> QuantizedWeight:
        """Rows ``first .. end - 1`` (a tensor-parallel column shard, a fused part)."""

    @abc.abstractmethod
    def cols(self, first: int, end: int) -> QuantizedWeight:
        """Columns ``first .. end - 1``; a ValueError naming the weight and the block size
        when a bound cuts a block."""

    @abc.abstractmethod
    def permute_rows(self, index: np.ndarray | torch.Tensor) -> QuantizedWeight:
        """Row ``i`` of the result is row ``index[i]`` of this weight."""

    @classmethod
    def _concat_rows(cls, parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
        """``parts`` (all of this class and qtype, same in_features) stacked by rows, or
        None where this class cannot stack them (e.g. different group sizes)."""
        return None

    def prepare(self, dtype: torch.dtype, device: torch.device) -> None:
        """Called once when the load has made this weight a layer's, with the dtype and
        device of the activations it will multiply: a class may repack itself for its
        kernels here (this one does nothing)."""
        return None

    def owned(self) -> QuantizedWeight:
        """This weight with storage of its own (a weight over a file's memory map, as the
        GGUF loader gives them, copied)."""
        return self

    def matmul_slices(self, x: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
        """x [T, in] multiplied in the row slices [r0, r1) of ``slices`` (together x's rows,
        in order): each slice's result bitwise ``matmul``'s of that slice alone (the
        deterministic mode's row tiles, ``model.layers.RowTiling``). This one calls
        ``matmul`` per slice; a class whose ``matmul`` dequantizes the weight overrides it to
        dequantize once."""
        out = x.new_empty(x.shape[0], self.shape[0])
        for r0, r1 in slices:
            out[r0:r1] = self.matmul(x[r0:r1])
        return out

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.qtype}, shape={self.shape})"

    def _check_x(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.shape[1]:
            raise ValueError(
                f"{self.name}: input of {x.shape[-1]} features for a weight of "
                f"{self.shape[1]} in_features"
            )
        if x.dtype not in _X_DTYPES:
            raise ValueError(f"{self.name}: input dtype {x.dtype} (takes float32/bfloat16)")

    def _check_range(self, what: str, first: int, end: int, size: int) -> None:
        if not 0 <= first < end <= size:
            raise ValueError(f"{self.name}: {what} {first}:{end} outside 0:{size}")


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """``parts`` stacked by rows as one weight when they all share class and qtype (and the
    class can stack them), else None (the caller runs one matmul per part and concatenates)."""
    if not parts:
        raise ValueError("concat_rows: no parts")
    first = parts[0]
    if any(p.shape[1] != first.shape[1] for p in parts):
        raise ValueError(
            f"concat_rows: parts of different in_features {[(p.name, p.shape[1]) for p in parts]}"
        )
    if any(type(p) is not type(first) or p.qtype != first.qtype for p in parts):
        return None
    return type(first)._concat_rows(parts)


class GGUFWeight(QuantizedWeight):
    """GGML block rows (``formats``): ``data`` uint8 [out, in / block_values * block_bytes],
    row r being the blocks of output channel r in file order."""

    def __init__(self, data: torch.Tensor, fmt: formats.Format, name: str) -> None:
        if data.dtype != torch.uint8 or data.dim() != 2 or data.device.type != "cpu":
            raise ValueError(f"{name}: {fmt.name} data must be a CPU uint8 [rows, row_bytes]")
        if data.shape[1] % fmt.block_bytes or data.shape[1] == 0:
            raise ValueError(
                f"{name}: {fmt.name} rows of {data.shape[1]} bytes are not whole "
                f"{fmt.block_bytes}-byte blocks"
            )
        self.data = data.contiguous()
        self.format = fmt
        self.qtype = fmt.name
        self.name = name
        self.shape = (data.shape[0], data.shape[1] // fmt.block_bytes * fmt.block_values)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, code: int, name: str, copy: bool = True) -> GGUFWeight:
        """A weight from a GGUF tensor's raw data (uint8 [rows, row_bytes] as ``GGUFReader``
        gives it, possibly a read-only memory map: copied; ``copy`` False: kept as a view of
        the map, read where ``rows`` / ``cols`` / ``owned`` copy from it, so that a
        tensor-parallel rank reads only its share). ``code``: its GGMLQuantizationType, one
        of ``formats.FORMATS`` (else a ValueError naming it)."""
        fmt = formats.get(code)
        if copy:
            raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 2:
            raise ValueError(
                f"{name}: GGUF {fmt.name} data must be uint8 [rows, row_bytes], got "
                f"{raw.dtype} {raw.shape}"
            )
        if copy:
            return cls(torch.from_numpy(np.array(raw, copy=True)), fmt, name)
        weight = cls.__new__(cls)
        weight.format, weight.qtype, weight.name = fmt, fmt.name, name
        weight.shape = (raw.shape[0], raw.shape[1] // fmt.block_bytes * fmt.block_values)
        if raw.shape[1] % fmt.block_bytes or raw.shape[1] == 0:
            raise ValueError(
                f"{name}: {fmt.name} rows of {raw.shape[1]} bytes are not whole "
                f"{fmt.block_bytes}-byte blocks"
            )
        weight.mapped = raw
        return weight

    mapped: np.ndarray | None = None  # the file's bytes, not yet copied (``from_gguf``)
    order: np.ndarray | None = None  # a mapped weight's rows: row i is the map's order[i]
    # The weight repacked for the kernels (``pack``; uint8 [out, row_bytes], the C file's
    # "packed weights" order), which then replaces the file's rows (``_data`` None).
    packed: torch.Tensor | None = None
    _pack_tried = False
    # The deterministic mode's kernel (``set_invariant_kernel``): "int8" (``kernels.gemm``)
    # or "bf16" (``kernels.gemm_bf16``, AMX-BF16, the file's rows: never packed).
    invariant_kernel = "int8"

    @property
    def data(self) -> torch.Tensor:
        """The file's block rows (uint8 [out, row_bytes]); of a packed weight a copy unpacked
        from ``packed`` (the load's edits and the float paths: not a decode step's)."""
        if self.mapped is not None:
            raise RuntimeError(f"{self.name}: a weight over a memory map used before owned()")
        if self.packed is not None:
            return self._unpack()
        return self._data

    def _unpack(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        k = kernels.built()
        assert k is not None and self.packed is not None  # packed only where they built
        return k.unpack(self.format.code, self.packed, self.shape[1], rows)

    def _row_range(self, first: int, end: int) -> torch.Tensor:
        """The file's rows first..end-1 (a view of ``_data``, or unpacked)."""
        if self.packed is None:
            return self.data[first:end]
        return self._unpack(torch.arange(first, end, dtype=torch.int64))

    def prepare(self, dtype: torch.dtype, device: torch.device) -> None:
        """Packed at load where the engine's products will be int8-activation ones (bf16 on
        a CPU, kernels on, no float opt-in); else at a first such product, if ever."""
        if (
            dtype == torch.bfloat16
            and device.type == "cpu"
            and kernels.enabled()
            and not kernels.float_kernel()
        ):
            self.pack()

    def pack(self) -> bool:
        """Repack into the batch-1 kernel's layout (see the module docstring) where the
        kernels are built, ``CHUNKSERVE_QUANT_PACK`` is not 0 and the format and rows allow
        it; whether the weight is packed. Tried once per weight."""
        if self.packed is not None:
            return True
        if self._pack_tried or self.mapped is not None:
            return False
        self._pack_tried = True
        k = kernels.built()
        if k is None or not kernels.packing() or not k.packable(self.format.code, self.shape[0]):
            return False
        if self.invariant_kernel == "bf16":  # gemm_bf16 reads the file's rows
            return False
        self.packed = k.pack(self.format.code, self._data, self.shape[1])
        self._data = None
        return True

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._data = value

    def owned(self) -> GGUFWeight:
        if self.mapped is None:
            return self
        rows = self.mapped if self.order is None else self.mapped[self.order]
        return GGUFWeight(torch.from_numpy(np.array(rows)), self.format, self.name)

    def _like(self, data: torch.Tensor) -> GGUFWeight:
        return GGUFWeight(data, self.format, self.name)

    @property
    def nbytes(self) -> int:
        return (self._data if self.packed is None else self.packed).numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raw = self.owned().data.numpy()
        values = formats.dequantize(raw, self.format.code)
        return torch.from_numpy(values).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise ValueError(f"{self.name}: row ids outside 0:{self.shape[0]}")
        if self.packed is not None:
            rows = self._like(self._unpack(flat))
        else:
            rows = self._like(self.data.index_select(0, flat))
        return rows.dequantize(dtype).reshape(*ids.shape, self.shape[1])

    def rows(self, first: int, end: int) -> GGUFWeight:
        self._check_range("rows", first, end, self.shape[0])
        if self.mapped is not None:  # only these rows read from the file
            rows = slice(first, end) if self.order is None else self.order[first:end]
            return self._like(torch.from_numpy(np.array(self.mapped[rows])))
        if self.packed is not None:
            return self._like(self._row_range(first, end))
        return self._like(self.data[first:end].clone())

    def cols(self, first: int, end: int) -> GGUFWeight:
        self._check_range("columns", first, end, self.shape[1])
        values, size = self.format.block_values, self.format.block_bytes
        if first % values or end % values:
            raise ValueError(
                f"{self.name}: columns {first}:{end} cut a {self.qtype} block of {values} "
                f"values (a split must fall on a multiple of {values})"
            )
        cut = slice(first // values * size, end // values * size)
        if self.mapped is not None:  # only these columns' blocks read from the file
            part = np.array(self.mapped[:, cut])
            return self._like(torch.from_numpy(part if self.order is None else part[self.order]))
        return self._like(self.data[:, cut].clone())

    def permute_rows(self, index: np.ndarray | torch.Tensor) -> GGUFWeight:
        idx = torch.as_tensor(np.asarray(index), dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.shape[0]):
            raise ValueError(f"{self.name}: row index outside 0:{self.shape[0]}")
        if self.mapped is not None:  # still a view of the map: the order composes
            weight = copy.copy(self)
            order = idx.numpy()
            weight.order = order if self.order is None else self.order[order]
            return weight
        return self._like(self.data.index_select(0, idx))

    @classmethod
    def _concat_rows(cls, parts: Sequence[QuantizedWeight]) -> GGUFWeight:
        first = parts[0]
        assert isinstance(first, GGUFWeight)
        data = torch.cat([p.data for p in parts if isinstance(p, GGUFWeight)])
        return GGUFWeight(data, first.format, "+".join(p.name for p in parts))

    def row_invariant(self, x: torch.Tensor) -> bool:
        return kernels.int8_activations(x) and kernels.load() is not None

    def set_invariant_kernel(self, name: str) -> bool:
        """ "bf16": ``matmul_row_invariant`` runs ``kernels.gemm_bf16`` (AMX-BF16 tiles over
        the weight dequantized to bf16, x not quantized) at every row count, the weight
        unpacked to the file's rows; a ValueError naming the option where this CPU (or the
        kernels' build) has no AMX-BF16. "int8": ``kernels.gemm`` (the default)."""
        if name not in ("int8", "bf16"):
            raise ValueError(f"deterministic_quant_kernel: 'int8' or 'bf16', got {name!r}")
        k = kernels.load()
        if name == "bf16":
            if k is None or not k.amx_bf16:
                why = "this CPU has no AMX-BF16" if k is not None else kernels.load_error()
                raise ValueError(
                    f"deterministic_quant_kernel: 'bf16' needs the quantized kernels with "
                    f"AMX-BF16 ({why or 'turned off: CHUNKSERVE_QUANT_KERNELS=0'}); use "
                    f"'int8' (any CPU)"
                )
            if self.packed is not None:
                self._data, self.packed = self._unpack(), None
        elif self.invariant_kernel != "int8":
            self._pack_tried = False  # packed again at the next product
        self.invariant_kernel = name
        return True

    def matmul_row_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The int8-activation kernel at every row count (bf16 x): a row's bits do not depend
        on its step's rows or the threads (the deterministic mode's path, no row tiling).
        With ``set_invariant_kernel("bf16")``, ``kernels.gemm_bf16`` at every row count
        instead (bf16 weights and x, fp32 tile sums in a fixed order)."""
        k = kernels.load() if self.invariant_kernel == "bf16" else None
        if k is not None and x.dtype == torch.bfloat16 and x.numel():
            if x.shape[-1] != self.shape[1]:
                self._check_x(x)
            x2 = x.reshape(-1, self.shape[1]).contiguous()  # [T, in]
            out = k.gemm_bf16(self.format.code, self.data, x2)
            return out.reshape(*x.shape[:-1], self.shape[0])
        return self._kernel_matmul(x, row_invariant=True)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 x: the int8-activation kernel (``kernels.gemm``: ~0.5% error, each row
        computed alone) at every row count, but where torch's bf16 GEMM runs on AMX or the
        kernel has no SIMD path (``kernels.int8_row_limit``) only up to
        ``kernels.INT8_MAX_ROWS`` rows: more rows (prefill chunks) there take row tiles
        dequantized by the kernel exactly as the reference does, multiplied in torch (equal
        to the reference). float32 x (or
        ``CHUNKSERVE_QUANT_FLOAT_KERNEL=1``): float arithmetic only, as a model dequantized
        at load computes, up to the order of the sums: decode rows (up to
        ``kernels.DECODE_MAX_ROWS``) take the float kernel (the weight dequantized exactly in
        registers, float32 sums), more rows the tiles. An fp32 engine is the one whose
        chunked, unchunked, cached and preempted runs give the same greedy tokens; int8
        activations would turn attention's last-bit differences between those runs into a
        flipped code now and then. No kernel (no compiler, a failed build,
        ``CHUNKSERVE_QUANT_KERNELS=0``) or a float16 / non-CPU x: the reference."""
        return self._kernel_matmul(x, row_invariant=False)

    def _kernel_matmul(self, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        # (Every decode step calls this ~4 times a layer: the common case's checks first.)
        if x.shape[-1] != self.shape[1] or x.dtype not in _X_DTYPES:
            self._check_x(x)
        k = kernels.load() if x.dtype in kernels.DTYPES and x.device.type == "cpu" else None
        if k is None or x.numel() == 0:
            return reference_matmul(self, x)
        flat = x.dim() == 2 and x.is_contiguous()
        x2 = x if flat else x.reshape(-1, self.shape[1]).contiguous()  # [T, in]
        code, m = self.format.code, x2.shape[0]
        int8 = x.dtype == torch.bfloat16 and not kernels.float_kernel()  # (a CPU x here)
        most = k.int8_max_rows
        if int8 and (row_invariant or most is None or m <= most):
            if self.packed is not None or (not self._pack_tried and self.pack()):
                out = k.gemm_packed(code, self.packed, x2)
            else:
                out = k.gemm(code, self._data, x2)
        elif not int8 and m <= kernels.DECODE_MAX_ROWS:
            out = k.gemm_float(code, self.data, x2)
        else:
            out = _tiled(
                self.shape[0],
                self.shape[1],
                x2,
                lambda r0, r1: k.dequantize(code, self._row_range(r0, r1), self.shape[1], x.dtype),
            )
        return out if flat else out.reshape(*x.shape[:-1], self.shape[0])


def invariant_arithmetic(kernel: str, dtype: torch.dtype, device: torch.device) -> str:
    """What the deterministic mode's products of GGUF weights run on, with
    ``deterministic_quant_kernel`` ``kernel`` and activations of ``dtype`` on ``device``:
    ``kernel`` ("int8", "bf16") where bf16 activations take the row-invariant kernels,
    "reference" where they take the dequantized tiles on the mode's row tiles (no kernels
    here, or the float opt-in: other bits), "float" for fp32 activations (float arithmetic on
    any machine). Instances that must give the same bits (a prefill/decode pair) compare it."""
    if dtype != torch.bfloat16:
        return "float"
    ok = device.type == "cpu" and kernels.load() is not None and not kernels.float_kernel()
    return kernel if ok else "reference"


def reference_matmul(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` with w dequantized to float32 and cast to x's dtype, in row tiles
    of at most ``REFERENCE_TILE_VALUES`` values: the arithmetic of a model dequantized at
    load, bit for bit for weights within one tile (a GEMM may block a tile differently from
    the whole weight, so larger ones, e.g. a tied embedding as the head, can differ in the
    last bits)."""
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    out = _tiled(
        out_features, in_features, x2, lambda r0, r1: weight.rows(r0, r1).dequantize(x.dtype)
    )
    return out.reshape(*x.shape[:-1], out_features)


def _tiled(
    out_features: int,
    in_features: int,
    x2: torch.Tensor,
    rows: Callable[[int, int], torch.Tensor],
    x_slices: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """``F.linear(x2, w)`` with w's rows r0:r1 given by ``rows(r0, r1)`` (in x2's dtype), at
    most ``REFERENCE_TILE_VALUES`` values at a time; ``x_slices``: x2's rows multiplied in
    these slices [s0, s1) (each tile dequantized once for all of them)."""
    tile = max(1, REFERENCE_TILE_VALUES // in_features)
    t = x2.shape[0]
    if tile >= out_features and x_slices is None:
        return F.linear(x2, rows(0, out_features))
    slices = x_slices or [(0, t)]
    out = torch.empty(t, out_features, dtype=x2.dtype)  # [T, out]
    for r0 in range(0, out_features, tile):
        r1 = min(r0 + tile, out_features)
        w = rows(r0, r1)
        for s0, s1 in slices:
            if r1 - r0 == out_features:  # a whole row of out: contiguous
                torch.mm(x2[s0:s1], w.t(), out=out[s0:s1])
            else:
                out[s0:s1, r0:r1] = F.linear(x2[s0:s1], w)
    return out
