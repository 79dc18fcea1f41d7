"""Executors run the model runner's steps: in this process, or on N tensor-parallel ranks.

With tensor parallelism, rank 0 lives in this process (it schedules and samples) and ranks
1..N-1 are worker processes started with ``spawn``. Each step rank 0 sends the step plan
down a pipe to every worker, then all ranks run it together. A worker that dies makes the
next collective or send fail at once (its sockets close); the executor then names the
rank and its cause (exit code, signal, or the worker's traceback).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

from paged_llm.config import EngineConfig
from paged_llm.distributed.group import TensorParallelGroup, create_store
from paged_llm.distributed.worker import WorkerSpec, run_worker
from paged_llm.engine.model_runner import ModelRunner, StepOutput, StepPlan
from paged_llm.engine.scheduler import ScheduledBatch

T = TypeVar("T")

logger = logging.getLogger(__name__)

# A worker gets this long to start (import torch, reach the rendezvous), and to stop.
_WORKER_START_TIMEOUT_S = 120.0
_WORKER_STOP_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot go on."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(
            f"Tensor-parallel worker rank {rank} failed: {cause}. The LLM cannot generate "
            "any more; shut it down and create a new one."
        )
        self.rank = rank
        self.cause = cause

    def __reduce__(self) -> tuple[type[WorkerError], tuple[int, str]]:
        # Pickled by data-parallel replicas: rebuilt from its fields, not its message.
        return type(self), (self.rank, self.cause)


class LocalExecutor:
    """One rank: the runner in this process."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.runner = ModelRunner(config, eos_token_ids)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.runner.execute(batch)

    def shutdown(self) -> None:
        self.runner.shutdown()


class _Worker:
    def __init__(self, rank: int, process: BaseProcess, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.traceback: str | None = None

    def receive(self) -> str | None:
        """The kind of the worker's next message; None once it has failed or gone."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            return None
        if kind == "error":
            self.traceback = payload
            return None
        return kind

    def cause_of_failure(self) -> str:
        """Why the worker stopped: its traceback if it sent one, else how it exited."""
        with contextlib.suppress(EOFError, OSError):
            # A closed pipe polls readable: stop at the first message that is not one.
            while self.traceback is None and self.conn.poll() and self.receive() is not None:
                pass
        if self.traceback is not None:
            return f"it raised an exception:\n{self.traceback}"
        self.process.join(_WORKER_STOP_TIMEOUT_S)
        code = self.process.exitcode
        if code is None:
            return "it stopped responding"
        if code < 0:
            return f"it was killed by signal {signal.Signals(-code).name}"
        return f"it exited with code {code}"


class MultiprocExecutor:
    """Rank 0 here, ranks 1..N-1 in worker processes."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        size = config.tensor_parallel_size
        self._failure: WorkerError | None = None
        store = create_store(size)
        context = get_context("spawn")
        self._workers: list[_Worker] = []
        for rank in range(1, size):
            conn, child_conn = context.Pipe()
            process = context.Process(
                target=run_worker,
                args=(WorkerSpec(config, rank, store.port), child_conn),
                name=f"paged_llm-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            self._workers.append(_Worker(rank, process, conn))
        # Workers end with this executor even if shutdown() is never called.
        self._finalizer = weakref.finalize(self, _stop_workers, list(self._workers))
        try:
            self._await_message("joined")
            config.platform.enter_rank_process(size)
            tp = TensorParallelGroup.connect(config.platform.distributed_backend, 0, size, store)
            self.runner = self._guarded(
                lambda: ModelRunner(config, eos_token_ids, tp, announce=self._announce)
            )
            self._await_message("ready")
        except BaseException:
            self._finalizer()
            raise
        self._store = store  # kept alive: workers hold connections to it
        logger.info("Tensor parallel: %d ranks (rank 0 here, %d workers).", size, size - 1)

    def _await_message(self, expected: str) -> None:
        """Wait for every worker to send ``expected``; a dead worker fails at once."""
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        pending = {worker.conn: worker for worker in self._workers}
        while pending:
            sentinels = {worker.process.sentinel: worker for worker in pending.values()}
            ready = wait([*pending, *sentinels], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                worker = next(iter(pending.values()))
                raise self._fail(worker, f"it did not start within {_WORKER_START_TIMEOUT_S} s")
            for handle in ready:
                if isinstance(handle, int):  # a sentinel: the process ended
                    raise self._fail(sentinels[handle], sentinels[handle].cause_of_failure())
                worker = pending[handle]  # type: ignore[index]
                if worker.receive() != expected:
                    raise self._fail(worker, worker.cause_of_failure())
                pending.pop(worker.conn, None)

    def _fail(self, worker: _Worker, cause: str) -> WorkerError:
        self._failure = WorkerError(worker.rank, cause)
        return self._failure

    def _announce(self, plan: StepPlan) -> None:
        message = pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                raise self._fail(worker, worker.cause_of_failure()) from None

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
            raise self._fail(dead, dead.cause_of_failure()) from error

    def _first_dead_worker(self) -> _Worker | None:
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

    def shutdown(self) -> None:
        if hasattr(self, "runner"):
            self.runner.shutdown()
        self._finalizer()


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask each worker to stop, then terminate and finally kill the ones that linger."""
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.send(("stop", None))
    deadline = time.monotonic() + _WORKER_STOP_TIMEOUT_S
    for worker in workers:
        worker.process.join(max(deadline - time.monotonic(), 0))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(_WORKER_STOP_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def create_executor(
    config: EngineConfig, eos_token_ids: frozenset[int]
) -> LocalExecutor | MultiprocExecutor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)
