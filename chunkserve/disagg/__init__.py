"""Prefill/decode disaggregation: a prefill instance computes a prompt's KV cache and sends
its blocks to the decode instance that asked, which then samples every token.

- ``connector``: the transfer interface (a handle, an inbox on the decode side, an outbox on
  the prefill side) and the factory; ``shm`` (one host) and ``torch_p2p``
  (torch.distributed point-to-point) implement it.
- ``remote``: the decode side: asks a prefill instance over HTTP, watches the inbox, copies
  arrived blocks into the KV pool.
- ``sender``: the prefill side: after each step, the blocks the step completed go out.
"""
