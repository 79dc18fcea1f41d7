"""Executors run the model runner's steps: in this process, or on N tensor-parallel ranks.

With tensor parallelism, rank 0 lives in this process (it schedules and samples) and ranks
1..N-1 are worker processes (`paged_llm.engine.worker`) under a `Supervisor`. Each step
rank 0 sends the step plan down a pipe to every worker, then all ranks run it together::

    rank 0 -> worker   ("step", StepPlan) | ("call", (method, args, kwargs)) | ("stop", None)
    worker -> rank 0   ("joined", None) once in the group, ("ready", None) after start-up,
                       ("result", value or CallFailure) after each call,
                       ("failed", ChildFailure) before it exits on an exception

A worker that dies makes the next collective or send fail at once (its sockets and pipe
close); the executor then names the rank and its cause (exit code, signal, or the worker's
exception and traceback).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

from paged_llm.config import EngineConfig
from paged_llm.distributed.group import TensorParallelGroup, create_store
from paged_llm.distributed.supervisor import Child, Supervisor, UnguardedScriptError, wait
from paged_llm.engine.model_runner import ModelRunner, StepOutput, StepPlan
from paged_llm.engine.scheduler import ScheduledBatch
from paged_llm.engine.worker import (
    CallFailure,
    RunnerMethod,
    WorkerSpec,
    call_on_runner,
    run_worker,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)

# A worker gets this long to start (import torch, reach the rendezvous), and to stop.
_WORKER_START_TIMEOUT_S = 120.0
_WORKER_STOP_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""

    def __init__(self, rank: int, cause: str, traceback: str | None = None) -> None:
        super().__init__(
            f"Tensor-parallel worker rank {rank} failed ({cause}). The LLM cannot generate "
            "any more; shut it down and create a new one."
            + ("" if traceback is None else f"\nThe worker's traceback:\n{traceback}")
        )
        self.rank = rank
        self.cause = cause
        self.traceback = traceback

    def __reduce__(self) -> tuple[type[WorkerError], tuple[int, str, str | None]]:
        # Pickled by data-parallel replicas: rebuilt from its fields, not its message.
        return type(self), (self.rank, self.cause, self.traceback)


class LocalExecutor:
    """One rank: the runner in this process."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.runner = ModelRunner(config, eos_token_ids)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.runner.execute(batch)

    def collective_rpc(
        self, method: RunnerMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` called on the model runner: a one-element list, as for N ranks."""
        return [call_on_runner(self.runner, method, args, kwargs or {})]

    def shutdown(self) -> None:
        self.runner.shutdown()


class MultiprocExecutor:
    """Rank 0 here, ranks 1..N-1 in worker processes."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        size = config.tensor_parallel_size
        self._failure: WorkerError | None = None
        store = create_store(size)
        self._supervisor = Supervisor(
            self,
            stop_timeout_s=_WORKER_STOP_TIMEOUT_S,
            terminate_timeout_s=_WORKER_STOP_TIMEOUT_S,
        )
        try:
            self._workers = [
                self._supervisor.spawn(
                    run_worker,
                    (WorkerSpec(config, rank, store.port),),
                    name=f"paged_llm-tp-rank{rank}",
                    daemon=True,
                )
                for rank in range(1, size)
            ]
            self._await_message("joined")
            config.platform.enter_rank_process(size)
            tp = TensorParallelGroup.connect(config.platform.distributed_backend, 0, size, store)
            self.runner = self._guarded(
                lambda: ModelRunner(config, eos_token_ids, tp, announce=self._announce)
            )
            self._await_message("ready")
        except BaseException:
            self._supervisor.stop()
            raise
        self._store = store  # kept alive: workers hold connections to it
        logger.info("Tensor parallel: %d ranks (rank 0 here, %d workers).", size, size - 1)

    def _await_message(self, expected: str) -> None:
        """Wait for every worker to send ``expected``; a worker that ends or sends anything
        else fails the executor at once."""
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        pending = list(self._workers)
        while pending:
            ready = wait(pending, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise self._fail(pending[0], f"did not start within {_WORKER_START_TIMEOUT_S} s")
            for worker in ready:
                kinds = [kind for kind, _ in worker.receive()]
                if kinds != [expected] or worker.ended or worker.failure is not None:
                    failure = self._fail(worker)
                    if worker.reran_script:
                        size = len(self._workers) + 1
                        raise UnguardedScriptError(f"tensor_parallel_size={size}", "worker")
                    raise failure
                pending.remove(worker)

    def _fail(self, worker: Child, cause: str | None = None) -> WorkerError:
        """The error of ``worker``'s failure, remembered: ``cause``, or how the process
        ended (reaped here)."""
        if cause is None:
            cause = worker.reap(_WORKER_STOP_TIMEOUT_S)
        traceback = None if worker.failure is None else worker.failure.traceback
        self._failure = WorkerError(self._workers.index(worker) + 1, cause, traceback)
        return self._failure

    def _announce(self, plan: StepPlan) -> None:
        message = pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            if not worker.send_pickled(message):
                raise self._fail(worker)

    def _guarded(self, action: Callable[[], T]) -> T:
        """Run ``action``; a failed collective is blamed on the worker that died."""
        try:
            return action()
        except RuntimeError as error:
            if isinstance(error, WorkerError):
                raise
            dead = self._first_dead_worker()
            if dead is None:
                raise
            raise self._fail(dead) from error

    def _first_dead_worker(self) -> Child | None:
        # A peer's socket closes a moment before its process is reaped.
        deadline = time.monotonic() + _WORKER_STOP_TIMEOUT_S
        while True:
            for worker in self._workers:
                if not worker.process.is_alive():
                    return worker
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if self._failure is not None:
            raise self._failure
        return self._guarded(lambda: self.runner.execute(batch))

    def collective_rpc(
        self, method: RunnerMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` called on every rank's model runner at once (so it may run
        collectives); the results by rank. The first exception raised on any rank is
        raised here, once every rank has answered."""
        if self._failure is not None:
            raise self._failure
        try:
            message = pickle.dumps(
                ("call", (method, args, kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL
            )
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ValueError(
                f"collective_rpc sends {method!r} and its arguments to the tensor-parallel "
                f"workers by pickle, and they do not pickle ({error}): pass a method name or a "
                "function defined at module level, with picklable arguments."
            ) from error
        for worker in self._workers:
            if not worker.send_pickled(message):
                raise self._fail(worker)
        try:
            results: list[Any] = [
                self._guarded(lambda: call_on_runner(self.runner, method, args, kwargs or {}))
            ]
        except Exception as error:
            results = [CallFailure("", error)]
        results.extend(self._await_results())
        for rank, result in enumerate(results):
            if isinstance(result, CallFailure):
                if result.exception is not None:
                    raise result.exception
                raise RuntimeError(f"collective_rpc failed on rank {rank}:\n{result.traceback}")
        return results

    def _await_results(self) -> list[Any]:
        """Every worker's answer to the call just sent, in rank order."""
        answers: dict[int, Any] = {}
        while len(answers) < len(self._workers):
            pending = [w for i, w in enumerate(self._workers) if i not in answers]
            for worker in wait(pending):
                messages = worker.receive()
                if worker.ended and not messages:
                    raise self._fail(worker)
                for kind, payload in messages:
                    if kind != "result":
                        raise self._fail(worker, f"sent {kind!r} while a call ran")
                    answers[self._workers.index(worker)] = payload
        return [answers[i] for i in range(len(self._workers))]

    def shutdown(self) -> None:
        if hasattr(self, "runner"):
            self.runner.shutdown()
        self._supervisor.stop()


def create_executor(
    config: EngineConfig, eos_token_ids: frozenset[int]
) -> LocalExecutor | MultiprocExecutor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)
