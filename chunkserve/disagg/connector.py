"""The KV transfer interface between a prefill and a decode instance.

A transfer moves the KV blocks of one prompt, ``[first_token, num_tokens)`` of it (the
decode side already holds the blocks before ``first_token``: a prefix it had cached), as
blocks ``0 .. num_blocks - 1`` of the transfer (block ``i`` holds tokens
``first_token + i * block_size ...``). The decode side opens an ``Inbox`` and sends its
``KVHandle`` (as a dict, inside the HTTP request that asks for the prefill); the prefill
side opens an ``Outbox`` from the handle and sends blocks in order as its chunks complete
them, so the transfer overlaps the rest of the prefill.

One block of a transfer, as it travels: ``[layers, 2 (K, V), block_size, num_kv_heads,
head_dim]`` in the model's dtype (``KVHandle.layout``, checked on both sides: a pair of
instances with different models, dtypes or block sizes fails the request, not the engine).

KV groups (a hybrid cache: ``KVHandle.windows``, one entry per group, None for full
attention): a block of the transfer is one group's layers for one block of tokens, and the
transfer is the pairs ``transfer_plan`` lists, token block by token block, group by group: a
full group's every block, a sliding group's only the blocks in the window of the token the
decode side computes next (``num_tokens``): the rest it would give back at once. Without a
window (one full group) the transfer is every block of the prompt's range, all layers.

Which connector a decode instance uses is its ``kv_connector`` setting; a prefill instance
takes whatever a handle names.

Pure Python here (no torch): the edge checks handles with it.
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

CONNECTOR_KINDS = ("shm", "torch")
_ID = re.compile(r"[0-9a-f]{32}")
_DTYPES = ("float32", "bfloat16", "float16")


class TransferError(RuntimeError):
    """A transfer failed (the peer is gone, a handle does not fit this instance)."""


def new_transfer_id() -> str:
    return secrets.token_hex(16)


def transfer_plan(
    first_token: int, num_tokens: int, windows: tuple[int | None, ...], block_size: int
) -> list[tuple[int, int]]:
    """The transfer's blocks as (KV group, token block) pairs, in the order they travel
    (see the module doc): token blocks ``first_token // block_size ..`` up to the one holding
    token ``num_tokens - 1``; a sliding group of window W only from the block holding
    ``num_tokens - W + 1`` (the first key the next token, at position ``num_tokens``, sees)."""
    start = first_token // block_size
    stop = -(-num_tokens // block_size)
    first_live = [
        start if w is None else max(start, max(0, num_tokens - w + 1) // block_size)
        for w in windows
    ]
    return [(g, i) for i in range(start, stop) for g in range(len(windows)) if i >= first_live[g]]


@dataclass(frozen=True)
class KVHandle:
    """Where one prompt's KV blocks go (made by the decode side; see the module doc)."""

    kind: str  # "shm" | "torch"
    transfer_id: str  # 32 hex digits
    address: str  # shm: the file's path; torch: "host:port" of the decode side's store
    first_token: int  # block-aligned
    num_tokens: int  # the prompt's tokens the prefill side computes (the decode side's n - 1)
    num_blocks: int
    layout: tuple[int, int, int, int, int]  # layers (of one KV group), 2, block_size, Hkv, hd
    dtype: str
    seq: int = 0  # torch: the transfer's number on its pair of instances
    pair: str = ""  # torch: the pair's key in the store (a new one after a failure)
    deterministic: bool = False  # the decode side runs the deterministic mode
    threads: int = 0  # its torch threads (0: not said)
    # Its deterministic attention arithmetic (``AttentionBackend.arithmetic``; "": not said)
    attention: str = ""
    # Its deterministic mode's kernel for quantized weights (``Worker.invariant_products``:
    # "int8", "bf16"; "": none, or not said)
    products: str = ""
    windows: tuple[int | None, ...] = (None,)  # the KV groups' windows (None: full)

    def plan(self) -> list[tuple[int, int]]:
        """The (KV group, token block) pair each block of the transfer holds."""
        return transfer_plan(self.first_token, self.num_tokens, self.windows, self.block_size)

    @property
    def block_size(self) -> int:
        return self.layout[2]

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.layout:
            n *= d
        return n

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layout"] = list(self.layout)
        d["windows"] = list(self.windows)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVHandle:
        """A handle sent by a client: ``ValueError`` naming the field for anything off."""
        name = "kv_transfer_params.send"
        if not isinstance(d, dict):
            raise ValueError(f"{name}: must be an object")
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{name}.{unknown[0]}: not a field of a KV handle")
        optional = {"seq", "pair", "windows", "deterministic", "threads", "attention", "products"}
        missing = sorted(fields - optional - set(d))
        if missing:
            raise ValueError(f"{name}.{missing[0]}: missing")

        def need(ok: bool, field: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{name}.{field}: {what}, got {d.get(field)!r}")

        def is_int(x: Any, lo: int = 0) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and lo <= x < 1 << 62

        need(d["kind"] in CONNECTOR_KINDS, "kind", f"must be one of {CONNECTOR_KINDS}")
        tid = d["transfer_id"]
        need(isinstance(tid, str) and _ID.fullmatch(tid) is not None, "transfer_id", "32 hex")
        need(isinstance(d["address"], str) and len(d["address"]) <= 512, "address", "a string")
        layout = d["layout"]
        need(
            isinstance(layout, (list, tuple))
            and len(layout) == 5
            and all(is_int(x, 1) and x < 1 << 20 for x in layout)
            and layout[1] == 2,
            "layout",
            "must be [num_layers, 2, block_size, num_kv_heads, head_dim]",
        )
        need(d["dtype"] in _DTYPES, "dtype", f"must be one of {_DTYPES}")
        bs = layout[2]
        need(is_int(d["first_token"]) and d["first_token"] % bs == 0, "first_token", "aligned")
        need(is_int(d["num_tokens"], d["first_token"] + 1), "num_tokens", "> first_token")
        windows = d.get("windows", [None])
        need(
            isinstance(windows, (list, tuple))
            and 1 <= len(windows) <= 256
            and all(w is None or (is_int(w, 1) and w < 1 << 40) for w in windows),
            "windows",
            "must be a list of 1-256 KV groups' windows (null: full attention, or an int >= 1)",
        )
        windows = tuple(windows)
        blocks = len(transfer_plan(d["first_token"], d["num_tokens"], windows, bs))
        need(d["num_blocks"] == blocks, "num_blocks", f"must be {blocks}")
        need(is_int(d.get("seq", 0)), "seq", "an integer >= 0")
        need(isinstance(d.get("deterministic", False), bool), "deterministic", "a boolean")
        need(is_int(d.get("threads", 0)) and d.get("threads", 0) < 1 << 16, "threads", ">= 0")
        need(isinstance(d.get("pair", ""), str) and len(d.get("pair", "")) <= 128, "pair", "str")
        attention = d.get("attention", "")
        need(isinstance(attention, str) and len(attention) <= 64, "attention", "a short string")
        products = d.get("products", "")
        need(isinstance(products, str) and len(products) <= 64, "products", "a short string")
        return cls(**{**d, "layout": tuple(layout), "windows": windows})

    def check_fits(
        self,
        layout: tuple[int, ...],
        dtype: str,
        windows: tuple[int | None, ...] = (None,),
        deterministic: bool = False,
        threads: int = 0,
        attention: str = "",
        products: str = "",
    ) -> None:
        """``TransferError`` unless this instance's KV blocks have the handle's layout and
        KV groups, and it runs the deterministic mode exactly when the decode side does
        (else the KV it computes, and so the decode side's tokens, would depend on this
        side's batches), at the decode side's thread count in fp32 (fp32 matmuls there
        depend on it; bf16's do not: ``model.layers.RowTiling``), with the decode side's
        attention arithmetic (bf16: AMX tiles on one machine, AVX512-BF16 ones on another
        give other bits) and kernel for quantized weights (``deterministic_quant_kernel``)."""
        if tuple(self.layout) != tuple(layout) or self.dtype != dtype:
            raise TransferError(
                f"kv_transfer_params.send: the decode instance's KV blocks are "
                f"{list(self.layout)} {self.dtype}, this instance's {list(layout)} {dtype} "
                f"(the same model, dtype and block size on both sides)"
            )
        if tuple(self.windows) != tuple(windows):
            raise TransferError(
                f"kv_transfer_params.send.windows: the decode instance's KV groups have "
                f"windows {list(self.windows)}, this instance's {list(windows)} (the same "
                f"model and --hybrid-kv-cache setting on both sides)"
            )
        if self.deterministic != deterministic:
            raise TransferError(
                f"kv_transfer_params.send.deterministic: the decode instance runs with "
                f"deterministic={self.deterministic}, this prefill instance with "
                f"deterministic={deterministic} (run both with --deterministic, or neither)"
            )
        if deterministic and dtype == "float32" and self.threads and threads != self.threads:
            raise TransferError(
                f"kv_transfer_params.send.threads: the decode instance runs {self.threads} "
                f"threads, this prefill instance {threads}; deterministic fp32 results depend "
                f"on the thread count (run both with the same --num-threads, or bf16)"
            )
        arithmetic = (  # (field, the decode side's, this side's, what it is, the remedy)
            ("attention", self.attention, attention, "attention arithmetic",
             "CHUNKSERVE_ATTENTION_AMX=0 keeps a machine with AMX on the AVX512-BF16 tiles"),
            ("products", self.products, products, "quantized-product kernel",
             "the same --deterministic-quant-kernel on both"),
        )  # fmt: skip
        for field, theirs, mine, what, remedy in arithmetic:
            if deterministic and theirs and mine and mine != theirs:  # "": not said
                raise TransferError(
                    f"kv_transfer_params.send.{field}: the decode instance's deterministic "
                    f"{what} is {theirs}, this prefill instance's {mine} (other bits; {remedy})"
                )


class Inbox(ABC):
    """The decode side of one transfer: blocks arrive in order."""

    handle: KVHandle

    @abstractmethod
    def num_ready(self) -> int:
        """Blocks ``0 .. num_ready() - 1`` have arrived (never decreases)."""

    @abstractmethod
    def read(self, start: int, stop: int) -> Any:
        """Blocks ``start .. stop - 1``: a tensor ``[stop - start, *layout]``."""

    def failed(self) -> str | None:
        """Why the transfer cannot complete (the connection broke), if so."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the transfer's resources (done, aborted or failed); idempotent."""


class Outbox(ABC):
    """The prefill side of one transfer."""

    @abstractmethod
    def send(self, start: int, blocks: Any) -> None:
        """Blocks ``start .. start + len(blocks) - 1`` of the transfer (a tensor
        ``[n, *layout]`` the outbox may keep: the caller made it for this). In order, each
        block once. Raises ``TransferError`` if the receiver is gone."""

    @abstractmethod
    def close(self) -> None:
        """The prefill is done or ended; idempotent."""


class KVConnector(ABC):
    """One instance's end of KV transfers (see the module doc)."""

    @abstractmethod
    def open_inbox(self, handle: KVHandle, peer: str) -> tuple[Inbox, KVHandle]:
        """Decode side: receive the transfer ``handle`` describes (its address filled in
        here) from the prefill instance ``peer``; returns the inbox and the handle to send."""

    @abstractmethod
    def open_outbox(self, handle: KVHandle) -> Outbox:
        """Prefill side: send to the inbox ``handle`` names."""

    def close(self) -> None:  # noqa: B027 (most connectors hold nothing to close)
        """Stop background threads and drop connections."""
