"""Data parallelism in one call: engine replicas in their own processes, fed by one `LLM`.

The `LLM` in the user's process keeps tokenization, validation and ordering, and drives a
`DataParallelEngine` the way it drives an `EngineCore` (add_request, step, abort_all,
get_metrics). The data-parallel engine loads no weights: it spreads the requests of a
generation over its replicas (`assign_replicas`), each of which runs them through its own
engine in one continuous batch and sends back each finished `RequestOutput`.

Each replica is a child of the front's `Supervisor` and talks to it over its two one-way
pipes::

    front -> replica   ("add", [ReplicaRequest, ...]) | ("abort", None | [request_id, ...])
                       | ("call", (method, args)) | ("stop", None)
    replica -> front   ("ready", EngineMetrics) | ("output", EngineOutput)
                       | ("reply", what the engine method returned) | ("failed", ChildFailure)

A replica reads its commands on a thread of its own, so the front never blocks on a full
pipe while the replica is busy sending results. The front waits on the result pipes and
the process sentinels together: a replica that dies is noticed at once, and the requests
it had not finished run again on the others.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from paged_llm.distributed.supervisor import Child, Supervisor, UnguardedScriptError, wait
from paged_llm.engine.core import EngineMetrics
from paged_llm.engine.request import EngineRequest
from paged_llm.engine.weight_updates import NamedTensors
from paged_llm.engine.worker import CallFailure, RunnerMethod
from paged_llm.frontend.engine_client import EngineClient, RequestsLostError
from paged_llm.frontend.replica_assignment import (
    ReplicaPlacement,
    assign_replicas,
    place_replicas,
    request_cost,
    resolve_seed,
)
from paged_llm.metrics import Metric
from paged_llm.outputs import EngineOutput

logger = logging.getLogger(__name__)

# How long a replica gets to finish its step and exit after "stop", and then after SIGTERM.
STOP_TIMEOUT_S = 10.0
TERMINATE_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """A validated request as sent to a replica, with its seed already fixed."""

    request: EngineRequest
    cost: int

    @property
    def request_id(self) -> str:
        return self.request.request_id


def _usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


# ----- the replica process ----------------------------------------------------------------


def _replica_main(
    engine_factory: Callable[[], EngineClient],
    placement: ReplicaPlacement,
    commands: Connection,
    results: Connection,
) -> None:
    """A replica process: build the engine, then serve commands until "stop" or the front
    goes away. An exception reaches the front as the replica's failure."""
    # NOTE: before the engine exists, so CUDA (initialized lazily) sees only our devices.
    os.environ.update(placement.environment)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(len(placement.cpus))
    # terminate() then still runs the finally below, which ends tensor-parallel workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    engine = engine_factory()
    try:
        results.send(("ready", engine.get_metrics()))
        inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(target=_read_commands, args=(commands, inbox), daemon=True).start()
        _serve(engine, inbox, results)
    finally:
        engine.shutdown()


def _read_commands(commands: Connection, inbox: queue.Queue[tuple[str, Any]]) -> None:
    while True:
        try:
            inbox.put(commands.recv())
        except (EOFError, OSError):
            inbox.put(("stop", None))  # the front is gone: end too, leave no orphan
            return


def _serve(engine: EngineClient, inbox: queue.Queue[tuple[str, Any]], results: Connection) -> None:
    while True:
        # Idle: wait for a command. Busy: take the commands that have come, then step.
        pending = [] if engine.has_unfinished() else [inbox.get()]
        while not inbox.empty():
            pending.append(inbox.get())
        for command, payload in pending:
            if command == "stop":
                return
            if command == "add":
                for sent in payload:
                    engine.add_request(sent.request)
            elif command == "abort":
                if payload is None:
                    engine.abort_all()
                else:
                    engine.abort_requests(payload)
            elif command == "call":
                method, args = payload
                results.send(("reply", _answer(engine, method, args)))
        if engine.has_unfinished():
            for output in engine.step():
                results.send(("output", output))


def _answer(engine: EngineClient, method: str, args: tuple[Any, ...]) -> Any:
    """The engine method's result, or its `CallFailure`: a refused call (a bad weight
    update) is the caller's error, and the replica serves on."""
    try:
        return getattr(engine, method)(*args)
    except (ValueError, RuntimeError) as error:
        return CallFailure(traceback.format_exc(), error)


# ----- the front --------------------------------------------------------------------------


@dataclass(eq=False)
class _Replica:
    """The front's view of one replica process."""

    rank: int
    child: Child
    metrics: EngineMetrics | None = None  # the last reported; kept after the replica ends
    # The answer to the last "call" command, once `reply_pending` is False.
    reply: Any = None
    reply_pending: bool = False
    outstanding: dict[str, ReplicaRequest] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return not self.child.ended

    @property
    def load(self) -> int:
        return sum(request.cost for request in self.outstanding.values())


class DataParallelEngine:
    """``num_replicas`` engines in their own processes, driven like one `EngineCore`.

    ``engine_factory`` builds one replica's engine inside its process (it is pickled: a
    module-level function or a `functools.partial` of one). Each replica runs on its own
    ``cores // num_replicas`` cores with as many torch threads and, on CUDA, on its own
    ``tensor_parallel_size`` devices (`place_replicas`).

    A request without a seed of its own gets the seed a single engine would have drawn for
    it (from ``seed`` and its arrival number), so outputs do not depend on the number of
    replicas or on which replica runs what. When a replica dies, its unfinished requests run
    again on the others; when none is left, `step` raises `RequestsLostError`.
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineClient],
        *,
        num_replicas: int,
        seed: int,
        block_size: int,
        max_model_len: int,
        tensor_parallel_size: int = 1,
        devices: Sequence[str] | None = None,
    ) -> None:
        self._seed = seed
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._num_requests = 0
        self._pending: list[ReplicaRequest] = []
        # Outputs received from the replicas and not yet returned by `step`.
        self._arrived: list[EngineOutput] = []
        self._lost: list[str] = []
        self._losses: list[str] = []
        # What `sleep` released in the replicas (see `sleeping`).
        self._sleeping: frozenset[str] = frozenset()
        placements = place_replicas(num_replicas, tensor_parallel_size, _usable_cpus(), devices)
        # Stops every replica when this engine is shut down, collected, or at exit.
        self._supervisor = Supervisor(
            self, stop_timeout_s=STOP_TIMEOUT_S, terminate_timeout_s=TERMINATE_TIMEOUT_S
        )
        try:
            # NOTE: not daemonic: a replica starts tensor-parallel workers of its own.
            self._replicas = [
                _Replica(
                    rank,
                    self._supervisor.spawn(
                        _replica_main,
                        (engine_factory, placement),
                        name=f"paged_llm-dp-replica-{rank}",
                    ),
                )
                for rank, placement in enumerate(placements)
            ]
            self._wait_until_started()
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_live_replicas(self) -> int:
        return sum(replica.alive for replica in self._replicas)

    @property
    def replica_pids(self) -> list[int | None]:
        """Process ids of the replicas, in rank order (for monitoring and tests)."""
        return [replica.child.process.pid for replica in self._replicas]

    def _wait_until_started(self) -> None:
        """Wait for every replica's "ready"; the first that ends instead raises its error
        (its own exception when it sent one that pickles)."""
        while all(replica.alive for replica in self._replicas) and any(
            replica.metrics is None for replica in self._replicas
        ):
            self._wait_for_events()
        failed = next((replica for replica in self._replicas if not replica.alive), None)
        if failed is None:
            return
        if failed.child.reran_script:
            raise UnguardedScriptError(f"data_parallel_size={len(self._replicas)}", "replica")
        failure = failed.child.failure
        message = f"Data-parallel replica {failed.rank} failed to start ({failed.child.cause()})"
        if failure is None:
            raise RuntimeError(message + ".")
        if failure.exception is not None:
            raise failure.exception from RuntimeError(f"{message}:\n{failure.traceback}")
        raise RuntimeError(f"{message}:\n{failure.traceback}")

    # ----- the engine interface -----------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a validated request; the next `step` sends it to a replica."""
        params = resolve_seed(request.params, self._seed, self._num_requests)
        self._num_requests += 1
        cost = request_cost(len(request.prompt_token_ids), params, self._max_model_len)
        self._pending.append(ReplicaRequest(replace(request, params=params), cost))

    def has_unfinished(self) -> bool:
        return bool(
            self._pending
            or self._arrived
            or self._lost
            or any(replica.outstanding for replica in self._replicas)
        )

    def step(self) -> list[EngineOutput]:
        """Send queued requests out, then wait for outputs: those of the requests that
        finished, and the progress of streaming ones (see `EngineCore.step`). Raises
        `RequestsLostError` for requests no replica is left to run."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._dispatch(pending)
        while not (self._arrived or self._lost) and self._has_outstanding():
            self._wait_for_events()
        if self._arrived:
            arrived, self._arrived = self._arrived, []
            return arrived
        if self._lost:
            lost, self._lost = self._lost, []
            raise RequestsLostError(
                f"{len(lost)} request(s) could not finish: no data-parallel replica is left "
                f"to run them. Lost: {'; '.join(self._losses)}.",
                lost,
            )
        return []

    def abort_all(self) -> None:
        """Drop every unfinished request; outputs of aborted requests that still arrive are
        ignored (request ids are never reused)."""
        self._pending.clear()
        self._arrived.clear()
        self._lost.clear()
        for replica in self._replicas:
            if replica.alive:
                replica.outstanding.clear()
                replica.child.send(("abort", None))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop these requests wherever they are; later outputs of them are ignored."""
        dropped = set(request_ids)
        self._pending = [sent for sent in self._pending if sent.request_id not in dropped]
        self._arrived = [output for output in self._arrived if output.request_id not in dropped]
        for replica in self._replicas:
            mine = [request_id for request_id in request_ids if request_id in replica.outstanding]
            for request_id in mine:
                del replica.outstanding[request_id]
            if mine and replica.alive:
                replica.child.send(("abort", mine))

    def reset_prefix_cache(self) -> bool:
        """Forget every replica's cached prefixes; False where a replica still runs
        requests."""
        return all(self._call_replicas("reset_prefix_cache").values())

    def _call_replicas(self, method: str, *args: Any) -> dict[int, Any]:
        """Call the engine method ``method`` in every live replica; their answers, by rank."""
        live = [replica for replica in self._replicas if replica.alive]
        for replica in live:
            replica.reply_pending = True
            replica.child.send(("call", (method, args)))
        while any(replica.alive and replica.reply_pending for replica in live):
            self._wait_for_events()
        replies = {replica.rank: replica.reply for replica in live if not replica.reply_pending}
        for reply in replies.values():
            if isinstance(reply, CallFailure):
                assert reply.exception is not None
                raise reply.exception
        return replies

    # ----- the weights and memory, in every replica --------------------------------------

    def collective_rpc(
        self, method: RunnerMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every rank of every replica: the results, replica by replica."""
        replies = self._call_replicas("collective_rpc", method, args, kwargs)
        return [result for rank in sorted(replies) for result in replies[rank]]

    def update_weights(self, weights: NamedTensors) -> None:
        """The same weights to every replica; each checks them whole before it changes
        anything, and all hold the same model, so a bad update changes none."""
        self._call_replicas("update_weights", weights)

    def sleep(self, level: int) -> None:
        self._call_replicas("sleep", level)
        self._note_sleeping()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_replicas("wake_up", tags)
        self._note_sleeping()

    def sleeping(self) -> frozenset[str]:
        """What `sleep` released in the replicas, as of the last sleep or wake-up: known
        here, so that every call can ask without a round trip."""
        return self._sleeping

    def _note_sleeping(self) -> None:
        self._sleeping = frozenset().union(*self._call_replicas("sleeping").values())

    def get_metrics(self) -> EngineMetrics:
        """The replicas' counters, summed; a replica that ended counts with its last report.
        A request that ran again after its replica died counts on both."""
        for rank, metrics in self._call_replicas("get_metrics").items():
            self._replicas[rank].metrics = metrics
        reports = [astuple(r.metrics) for r in self._replicas if r.metrics is not None]
        return EngineMetrics(*(sum(column) for column in zip(*reports, strict=True)))

    def get_stat_metrics(self, model_name: str) -> list[Metric]:
        """vLLM's metrics of every live replica, labelled ``engine`` with its rank: one
        series per name and replica, grouped by name as vLLM lists its engines'."""
        per_replica = [
            [replace(metric, labels={**metric.labels, "engine": str(rank)}) for metric in metrics]
            for rank, metrics in self._call_replicas("get_stat_metrics", model_name).items()
        ]
        return [metric for series in zip(*per_replica, strict=True) for metric in series]

    def shutdown(self) -> None:
        """End every replica process: ask, then terminate, then kill; join them all."""
        self._supervisor.stop()

    # ----- the front's event loop ---------------------------------------------------------

    def _has_outstanding(self) -> bool:
        return any(replica.outstanding for replica in self._replicas)

    def _dispatch(self, requests: list[ReplicaRequest]) -> None:
        live = [replica for replica in self._replicas if replica.alive]
        if not live:
            self._lost.extend(request.request_id for request in requests)
            return
        assignment = assign_replicas(
            [request.request.prompt_token_ids for request in requests],
            [request.cost for request in requests],
            [replica.load for replica in live],
            self._block_size,
        )
        batches: dict[int, list[ReplicaRequest]] = defaultdict(list)
        for request, position in zip(requests, assignment, strict=True):
            batches[position].append(request)
        for position, batch in batches.items():
            replica = live[position]
            # NOTE: outstanding before sending: a send to a replica that died fails, and its
            # death (noticed on its sentinel) reruns the batch elsewhere.
            replica.outstanding.update((request.request_id, request) for request in batch)
            replica.child.send(("add", batch))

    def _wait_for_events(self) -> None:
        """Block until a live replica sends something or ends, and handle it."""
        live = [replica for replica in self._replicas if replica.alive]
        ready = wait([replica.child for replica in live])
        for replica in live:
            if replica.child in ready:
                self._receive(replica)

    def _receive(self, replica: _Replica) -> None:
        """Handle every message waiting from ``replica``; what it sent before it ended
        still counts."""
        for kind, payload in replica.child.receive():
            if kind == "output":
                if not payload.finished:
                    if payload.request_id in replica.outstanding:
                        self._arrived.append(payload)
                elif replica.outstanding.pop(payload.request_id, None) is not None:
                    self._arrived.append(payload)
            elif kind == "ready":
                replica.metrics = payload
            elif kind == "reply":
                replica.reply = payload
                replica.reply_pending = False
        if not replica.alive:
            self._lose(replica)

    def _lose(self, replica: _Replica) -> None:
        """``replica`` has ended: record why, and run its unfinished requests elsewhere."""
        cause = replica.child.reap(TERMINATE_TIMEOUT_S)
        self._losses.append(f"replica {replica.rank} ({cause})")
        orphans = list(replica.outstanding.values())
        replica.outstanding.clear()
        logger.warning(
            "Data-parallel replica %d ended (%s); %d unfinished request(s) run again on the %d "
            "replica(s) left.%s",
            replica.rank,
            cause,
            len(orphans),
            self.num_live_replicas,
            "" if replica.child.failure is None else f"\n{replica.child.failure.traceback}",
        )
        if orphans:
            self._dispatch(orphans)
