"""Checkpoint tensors read where they are sliced.

A tensor-parallel rank keeps a slice of most checkpoint tensors (``layers.Target``: its
``tensor[src]``, a tuple of slices). The loaders (``loader.iter_weights``) yield float
tensors as ``LazyTensor``s: ``t[src]`` reads only what ``src`` selects from the file, steps
included (GPT-OSS's interleaved gate and up columns): safetensors' ``get_slice``, a GGUF
file's memory map (a block-quantized tensor: whole rows of blocks, the columns cut after
dequantizing), then casts, so a rank reads its share of the checkpoint, not the whole of
it. A quantized HF checkpoint's raw tensors come the same way, and
``hf_quant.LazyDequant`` reads and dequantizes the blocks its slice touches.

A ``LazyTensor`` has what the weight loaders use of a tensor: ``shape``, ``dtype``,
``element_size()``, ``to(dtype)`` (no read: the cast happens at the read) and ``[src]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# safetensors' dtype names -> torch's.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

Box = tuple[slice, ...]


class LazyTensor:
    """A tensor of ``shape`` whose values ``read(box)`` returns for a box (a tuple of
    slices with positive steps, one per dim, each selecting at least one index) in the
    stored ``raw_dtype``; ``t[src]`` is the stored tensor's ``[src]`` in ``dtype``."""

    def __init__(
        self,
        shape: tuple[int, ...] | torch.Size,
        raw_dtype: torch.dtype,
        read: Callable[[Box], torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.raw_dtype = raw_dtype
        self.dtype = raw_dtype if dtype is None else dtype
        self._read = read

    def __repr__(self) -> str:
        return f"LazyTensor({tuple(self.shape)}, {self.dtype})"

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def to(self, dtype: torch.dtype) -> LazyTensor:
        return LazyTensor(self.shape, self.raw_dtype, self._read, dtype)

    def __getitem__(self, src: slice | tuple[slice, ...]) -> torch.Tensor:
        if not isinstance(src, tuple):
            src = (src,)
        if len(src) > len(self.shape) or not all(isinstance(s, slice) for s in src):
            raise TypeError(f"LazyTensor: index by a tuple of slices, got {src!r}")
        src = (*src, *[slice(None)] * (len(self.shape) - len(src)))
        box, out = [], []
        for s, n in zip(src, self.shape, strict=True):
            start, stop, step = s.indices(n)
            if step < 1:
                raise TypeError(f"LazyTensor: negative steps are not supported, got {s!r}")
            count = max(0, -(-(stop - start) // step))
            out.append(count)
            box.append(slice(start, start + (count - 1) * step + 1 if count else start, step))
        if 0 in out:
            return torch.empty(out, dtype=self.dtype)
        return self._read(tuple(box)).to(self.dtype)

    def full(self) -> torch.Tensor:
        return self[()]

    def permute(self, *dims: int) -> LazyTensor:
        """The tensor with its dims in the order ``dims`` (a box reads the stored one's)."""
        shape = tuple(self.shape[d] for d in dims)
        inverse = [dims.index(d) for d in range(len(dims))]

        def read(box: Box) -> torch.Tensor:
            return self._read(tuple(box[inverse[d]] for d in range(len(dims)))).permute(*dims)

        return LazyTensor(shape, self.raw_dtype, read, self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """``length`` indices of dim ``dim`` from ``start`` (a box reads only those)."""
        dim %= len(self.shape)
        shape = (*self.shape[:dim], length, *self.shape[dim + 1 :])

        def read(box: Box) -> torch.Tensor:
            s = box[dim]
            moved = slice(s.start + start, s.stop + start, s.step)
            return self._read((*box[:dim], moved, *box[dim + 1 :]))

        return LazyTensor(shape, self.raw_dtype, read, self.dtype)


def safetensors_tensor(handle: object, name: str) -> LazyTensor:
    """Tensor ``name`` of an open safetensors file (``safe_open``), read by slices."""
    part = handle.get_slice(name)  # type: ignore[attr-defined]
    kind = part.get_dtype()
    if kind not in SAFETENSORS_DTYPES:
        raise ValueError(f"model: safetensors tensor {name!r} has dtype {kind}, not supported")

    def read(box: Box) -> torch.Tensor:
        return part[box] if box else handle.get_tensor(name)  # type: ignore[attr-defined]

    return LazyTensor(tuple(part.get_shape()), SAFETENSORS_DTYPES[kind], read)
