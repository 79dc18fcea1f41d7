"""A tensor-parallel worker process: rank r > 0 of one engine.

It holds its shard of the weights and of the KV cache and no scheduling state: it runs
each step rank 0 sends, taking part in the collectives inside the model. Messages come
over a pipe from rank 0; a closed pipe (rank 0 gone) ends the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from paged_llm.config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with."""

    config: EngineConfig
    rank: int
    store_port: int


# Messages, rank 0 -> worker: ("step", StepPlan) | ("stop", None).
# Worker -> rank 0: ("joined", None) once in the group, ("ready", None) after start-up,
# ("error", traceback text) before it exits on a failure.


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The worker's main loop (the target of its process)."""
    # Ctrl-C reaches the whole process group; rank 0 decides how the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(spec, conn)
    except (EOFError, BrokenPipeError):
        return  # rank 0 is gone
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    # Imported here: the import itself (torch, the models) happens inside the worker.
    from paged_llm.distributed.group import TensorParallelGroup, join_store
    from paged_llm.engine.model_runner import ModelRunner

    config = dataclasses.replace(spec.config, platform=spec.config.platform.for_rank(spec.rank))
    size = config.tensor_parallel_size
    config.platform.enter_rank_process(size)
    store = join_store(spec.store_port, size)
    conn.send(("joined", None))
    tp = TensorParallelGroup.connect(config.platform.distributed_backend, spec.rank, size, store)
    runner = ModelRunner(config, frozenset(), tp)
    conn.send(("ready", None))
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            runner.shutdown()
            return
        runner.follow(payload)
