"""The main of a tensor-parallel rank process other than 0 (``main``, started by
``launch.LocalRanks`` as a ``distributed.child.ChildProcess``; or ``run_rank`` called by
``chunkserve serve`` under a launcher)."""

from __future__ import annotations

import logging
import signal

from chunkserve.config import EngineConfig
from chunkserve.distributed.launch import RankSpec
from chunkserve.model.loader import load_model_config, resolve_model
from chunkserve.worker.worker import Worker

logger = logging.getLogger("chunkserve.tp")


def run_rank(config: EngineConfig, spec: RankSpec) -> None:
    """A rank other than 0: load its shard, then follow rank 0's steps until told to stop
    or the group breaks."""
    source = resolve_model(
        config.model,
        weights=config.load_format != "dummy",
        revision=config.revision,
        download_dir=config.download_dir,
    )
    model_config, reader = load_model_config(source)
    worker = Worker(config, model_config, config.resolve_max_model_len(model_config), spec)
    worker.load(source, reader, max_num_seqs=1)
    worker.follow()


def main(config: EngineConfig, spec: RankSpec, log_level: int) -> int:
    """A rank process's main; its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s"
    )
    try:
        run_rank(config, spec)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0
