"""The KV connectors of one instance, made on first use (``connector`` has the interface;
``shm`` and ``torch_p2p`` implement it and import it, so the factory stands apart)."""

from __future__ import annotations

from typing import Any

from chunkserve.disagg.connector import (
    CONNECTOR_KINDS,
    Inbox,
    KVConnector,
    KVHandle,
    Outbox,
)


class Connectors:
    """The connectors of one instance, made on first use: its own kind for inboxes, and any
    kind a handle names for outboxes."""

    def __init__(self, kind: str, host: str, device: Any) -> None:
        if kind not in CONNECTOR_KINDS:
            raise ValueError(f"kv_connector: must be one of {CONNECTOR_KINDS}, got {kind!r}")
        self.kind, self.host, self.device = kind, host, device
        self._made: dict[str, KVConnector] = {}

    def get(self, kind: str) -> KVConnector:
        conn = self._made.get(kind)
        if conn is None:
            if kind == "shm":
                from chunkserve.disagg.shm import ShmConnector

                conn = ShmConnector()
            else:
                from chunkserve.disagg.torch_p2p import TorchConnector

                conn = TorchConnector(self.host, self.device)
            self._made[kind] = conn
        return conn

    def open_inbox(self, handle: KVHandle, peer: str) -> tuple[Inbox, KVHandle]:
        return self.get(self.kind).open_inbox(handle, peer)

    def open_outbox(self, handle: KVHandle) -> Outbox:
        return self.get(handle.kind).open_outbox(handle)

    def close(self) -> None:
        for conn in self._made.values():
            conn.close()
        self._made.clear()
