"""A tensor-parallel worker process: rank r > 0 of one engine.

It holds its shard of the weights and of the KV cache and no scheduling state: it runs
each step rank 0 sends, taking part in the collectives inside the model, and each call
(`collective_rpc`) on its model runner. Its messages with rank 0 are listed in
`paged_llm.engine.executor`; a closed command pipe (rank 0 gone) ends it.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

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
        if kind == "call":
            results.send(("result", _answer(runner, *plan)))
        else:
            runner.follow(plan)


# What `collective_rpc` calls on each rank: a method name of `ModelRunner`, or a function
# taking the runner first (vLLM's convention for a callable).
RunnerMethod = str | Callable[..., Any]


def call_on_runner(
    runner: ModelRunner, method: RunnerMethod, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if callable(method):
        return method(runner, *args, **kwargs)
    return getattr(runner, method)(*args, **kwargs)


def apply_to_model(runner: ModelRunner, func: Callable[[Any], Any]) -> Any:
    """vLLM's ``apply_model`` on one rank: ``func`` of the rank's model."""
    return func(runner.model)


@dataclass(frozen=True)
class CallFailure:
    """A call that raised on a worker: its traceback, and the exception where it pickles."""

    traceback: str
    exception: BaseException | None


def _answer(
    runner: ModelRunner, method: RunnerMethod, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The call's result, or its `CallFailure`: the worker lives on for the next call."""
    try:
        return call_on_runner(runner, method, args, kwargs)
    except Exception as error:
        try:
            pickle.dumps(error)
        except Exception:
            return CallFailure(traceback.format_exc(), None)
        return CallFailure(traceback.format_exc(), error)
