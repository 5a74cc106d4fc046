"""Starting a tensor-parallel group: who is which rank, where the store is, which processes
to start, and the main of a rank process.

Three ways to get ``tensor_parallel_size`` ranks:

- one node (the default): the engine core is rank 0; it starts ranks 1..N-1 as processes of
  its own (``child.ChildProcess`` running ``chunkserve.worker.tp_rank:main``, as engine
  cores are started) and hosts the group's store on a free loopback port;
- several nodes: every node runs ``chunkserve serve --tensor-parallel-size N --nnodes M
  --node-rank K`` with ``MASTER_ADDR`` / ``MASTER_PORT`` naming node 0 (which serves and hosts
  the store); node K starts ranks ``K * N/M .. (K+1) * N/M - 1``; nodes other than 0 serve
  nothing (headless);
- a launcher (``torchrun`` or any that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``LOCAL_RANK``): each process is one rank; rank 0 serves, the others run
  the rank loop (``chunkserve serve`` does the right thing in each).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkserve.config import EngineConfig
from chunkserve.distributed import child
from chunkserve.distributed.child import ChildProcess

if TYPE_CHECKING:  # torch.distributed is imported where a store is made: the API server's
    import torch.distributed as dist  # process only names ``RANK_MAIN`` (no torch there)

logger = logging.getLogger("chunkserve.tp")

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # ranks of other nodes may load slowly


# The main of a rank process (``child.ChildProcess`` target).
RANK_MAIN = "chunkserve.worker.tp_rank:main"


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join its group."""

    rank: int
    size: int
    local_rank: int  # its index on its node (its GPU on CUDA)
    master_addr: str
    master_port: int


def launcher_env() -> dict[str, str] | None:
    """The launcher's variables when a launcher (torchrun, ...) started this process as one
    rank, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return dict(os.environ)
    return None


def _master_from_env(what: str) -> tuple[str, int]:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError(
            f"{what}: set MASTER_ADDR and MASTER_PORT to node 0's address and a free port "
            f"(the tensor-parallel group's store)"
        )
    try:
        return addr, int(port)
    except ValueError:
        raise ValueError(f"MASTER_PORT: not a port number: {port!r}") from None


def launcher_rank(config: EngineConfig) -> RankSpec | None:
    """This process's rank under a launcher (checked against the config), else None."""
    env = launcher_env()
    if env is None or config.tensor_parallel_size == 1:
        return None
    world = int(env["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size: {config.tensor_parallel_size}, but the launcher started "
            f"WORLD_SIZE={world} processes"
        )
    addr, port = _master_from_env("tensor_parallel_size")
    rank = int(env["RANK"])
    return RankSpec(rank, world, int(env.get("LOCAL_RANK", rank)), addr, port)


def connect_store(spec: RankSpec) -> dist.Store:
    """The group's store as a client (ranks other than 0)."""
    import torch.distributed as dist

    return dist.TCPStore(
        spec.master_addr, spec.master_port, spec.size, is_master=False, timeout=STORE_TIMEOUT
    )


class LocalRanks:
    """The rank processes this one started (``child.ChildProcess``), by rank."""

    def __init__(self, processes: dict[int, ChildProcess]) -> None:
        self.processes = processes

    @classmethod
    def start(cls, config: EngineConfig, specs: list[RankSpec]) -> LocalRanks:
        log_level = logging.getLogger("chunkserve").getEffectiveLevel()
        procs: dict[int, ChildProcess] = {}
        try:
            for spec in specs:
                procs[spec.rank] = ChildProcess.start(
                    f"tensor-parallel rank {spec.rank}", RANK_MAIN, (config, spec, log_level)
                )
        except BaseException:
            cls(procs).stop(0.0)
            raise
        return cls(procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    def check(self) -> None:
        """Raise ``ProcessExited`` if one of the ranks has exited."""
        child.check_alive(self.processes.values())

    def wait_any(self) -> int:
        """Block until one rank exits; its exit code."""
        code = child.wait_any(self.processes.values()).exitcode
        assert code is not None
        return code

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the ranks to exit, then kill the rest."""
        child.stop(self.processes.values(), timeout)


def start_rank0(config: EngineConfig) -> tuple[dist.Store, LocalRanks | None]:
    """Rank 0's side (the engine core): host the store (or reach the launcher's), start this
    node's other ranks. Returns the store and the processes started."""
    import torch.distributed as dist

    size = config.tensor_parallel_size
    spec = launcher_rank(config)
    if spec is not None:
        if spec.rank != 0:
            raise ValueError(f"RANK: the engine core is rank 0, not {spec.rank}")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            # torchrun's agent already serves a store at MASTER_PORT: be its client.
            return connect_store(spec), None
        store = dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            spec.size,
            is_master=True,
            wait_for_workers=False,
            timeout=STORE_TIMEOUT,
        )
        return store, None
    if config.nnodes > 1:
        addr, port = _master_from_env("nnodes")
    else:
        addr, port = "127.0.0.1", 0  # a free port, chosen by the store as it binds
    store = dist.TCPStore(
        addr, port, size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )
    per_node = size // config.nnodes
    specs = [RankSpec(r, size, r, addr, store.port) for r in range(1, per_node)]
    ranks = LocalRanks.start(config, specs) if specs else None
    return store, ranks


def node_specs(config: EngineConfig) -> list[RankSpec]:
    """The ranks a node other than 0 runs (headless)."""
    addr, port = _master_from_env("node_rank")
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    return [
        RankSpec(first + i, config.tensor_parallel_size, i, addr, port) for i in range(per_node)
    ]


def run_headless(config: EngineConfig) -> int:
    """A node other than 0: run its ranks until one exits (the engine ended or failed);
    then stop the others. Returns the exit code."""
    ranks = LocalRanks.start(config, node_specs(config))
    logger.info(
        "headless node %d: tensor-parallel ranks %s (pids %s) joining %s:%s",
        config.node_rank,
        sorted(ranks.processes),
        ranks.pids,
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
    )
    try:
        code = ranks.wait_any()
    finally:
        ranks.stop(10.0)
    return code
