"""A tensor-parallel worker process: rank r > 0 of one engine.

It holds its shard of the weights and of the KV cache and no scheduling state: it runs
each step rank 0 sends, taking part in the collectives inside the model. Its messages with
rank 0 are listed in `paged_llm.engine.executor`; a closed command pipe (rank 0 gone) ends
it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from multiprocessing.connection import Connection

from paged_llm.config import EngineConfig
from paged_llm.distributed.group import TensorParallelGroup, join_store
from paged_llm.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with."""

    config: EngineConfig
    rank: int
    store_port: int


def run_worker(spec: WorkerSpec, commands: Connection, results: Connection) -> None:
    """The worker's main loop (the target of its process, under the supervisor)."""
    config = dataclasses.replace(spec.config, platform=spec.config.platform.for_rank(spec.rank))
    size = config.tensor_parallel_size
    config.platform.enter_rank_process(size)
    store = join_store(spec.store_port, size)
    results.send(("joined", None))
    tp = TensorParallelGroup.connect(config.platform.distributed_backend, spec.rank, size, store)
    runner = ModelRunner(config, frozenset(), tp)
    results.send(("ready", None))
    while True:
        try:
            kind, plan = commands.recv()
        except EOFError:
            return  # rank 0 is gone
        if kind == "stop":
            runner.shutdown()
            return
        runner.follow(plan)
