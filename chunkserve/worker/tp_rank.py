"""The main of a tensor-parallel rank process other than 0 (``main``, started by
``launch.LocalRanks`` as a ``distributed.child.ChildProcess``; or ``run_rank_and_exit`` called
by ``chunkserve serve`` under a launcher)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

from chunkserve.config import EngineConfig
from chunkserve.distributed.launch import RankSpec
from chunkserve.model.loader import load_model_config
from chunkserve.model.source import config_source
from chunkserve.worker.worker import Worker

logger = logging.getLogger("chunkserve.tp")


def run_rank(config: EngineConfig, spec: RankSpec) -> None:
    """A rank other than 0: load its shard, then follow rank 0's steps until told to stop
    or the group breaks."""
    source = config_source(config)
    model_config, reader = load_model_config(source)
    worker = Worker(config, model_config, config.resolve_max_model_len(model_config), spec)
    worker.load(source, reader, max_num_seqs=1)
    worker.follow()


def run_rank_and_exit(config: EngineConfig, spec: RankSpec) -> NoReturn:
    """``run_rank``, then end the process at once: exit code 0 when told to stop, 1 when it
    failed. The rank has nothing to save, and an interpreter's normal exit tears down gloo's
    native threads and the collectives' objects in no fixed order: now and then one was
    destroyed while still joinable and the process aborted ("terminate called without an
    active exception", exit -6) after a clean stop."""
    code = 0
    try:
        run_rank(config, spec)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(config: EngineConfig, spec: RankSpec, log_level: int) -> NoReturn:
    """A rank process's main (``launch.LocalRanks`` starts it); never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s"
    )
    run_rank_and_exit(config, spec)
