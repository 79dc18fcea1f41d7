"""Data parallelism in one call: engine replicas in their own processes, fed by one `LLM`.

The `LLM` in the user's process keeps tokenization, validation and ordering, and drives a
`DataParallelEngine` the way it drives an `LLMEngine` (add_request, step, abort_all,
get_metrics). The data-parallel engine loads no weights: it spreads the requests of a
generation over its replicas (`assign_replicas`), each of which runs them through its own
engine in one continuous batch and sends back each finished `RequestOutput`.

Each replica talks to the front over two one-way pipes::

    front -> replica   ("add", [ReplicaRequest, ...]) | ("abort", None) | ("metrics", None)
                       | ("stop", None)
    replica -> front   ("ready", EngineMetrics) | ("output", RequestOutput)
                       | ("metrics", EngineMetrics) | ("failed", ReplicaFailure)

A replica reads its commands on a thread of its own, so the front never blocks on a full
pipe while the replica is busy sending results. The front waits on the result pipes and
the process sentinels together: a replica that dies is noticed at once, and the requests
it had not finished run again on the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, field, replace
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch
import torch.multiprocessing

from paged_llm.engine.llm_engine import EngineMetrics
from paged_llm.engine.sequence import derive_seed
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# How long a replica gets to finish its step and exit after "stop", and then after SIGTERM.
STOP_TIMEOUT_S = 10.0
TERMINATE_TIMEOUT_S = 3.0


class ReplicaEngine(Protocol):
    """What a replica needs of its engine: `LLMEngine`'s driving methods."""

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> object: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_all(self) -> None: ...

    def get_metrics(self) -> EngineMetrics: ...

    def shutdown(self) -> None: ...


class ReplicasLostError(RuntimeError):
    """No replica is left to run ``request_ids``; the message names each lost replica and
    why it ended."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """A validated request as sent to a replica, with its seed already fixed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    bad_words_token_ids: list[list[int]] | None
    cost: int


@dataclass(frozen=True, slots=True)
class ReplicaFailure:
    """Why a replica process gave up: its traceback, and the exception itself when it pickles
    (so a start-up ValueError reaches the user as the ValueError it is)."""

    traceback: str
    exception: BaseException | None

    @property
    def summary(self) -> str:
        """The traceback's last line, e.g. ``ValueError: ...``."""
        return self.traceback.strip().splitlines()[-1]


# ----- assignment (pure) ------------------------------------------------------------------


def request_cost(
    num_prompt_tokens: int, params: SamplingParams | BeamSearchParams, max_model_len: int
) -> int:
    """Tokens a request makes its replica process: the prompt, and up to ``max_tokens`` for
    each of its ``n`` sequences or beams (``max_tokens=None`` runs up to
    ``max_model_len``)."""
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    return num_prompt_tokens + max_tokens * params.n


def resolve_seed(
    params: SamplingParams | BeamSearchParams, engine_seed: int, serial: int
) -> SamplingParams | BeamSearchParams:
    """``params`` with the base seed that a single `LLMEngine` seeded ``engine_seed`` draws
    for its arrival number ``serial``, when the request has no seed of its own. Fixed by the
    front, it makes a request's tokens independent of which replica runs it and of that
    replica's own arrival count."""
    # NOTE: LLMEngine.add_request's formula; a replica then derives each sequence's seed
    # from this base exactly as a single engine does. A beam search has no seed to fix (as
    # in vLLM): its draws above temperature 0 follow the replica's own arrival count.
    if isinstance(params, BeamSearchParams) or params.seed is not None:
        return params
    return replace(params, seed=derive_seed(engine_seed, serial))


def assign_replicas(
    prompts: Sequence[list[int]],
    costs: Sequence[int],
    loads: Sequence[int],
    block_size: int,
) -> list[int]:
    """The replica (an index into ``loads``) of each request, so that the replicas finish
    together and prompts that can share KV blocks run on the same replica.

    Requests whose prompts start with the same full KV block form a prefix group (a prompt
    shorter than one block shares nothing and is a group of its own). Groups are placed
    costliest first, as in longest-processing-time scheduling, each on the least-loaded
    replica; its members follow in token order (so those sharing the longest prefixes are
    neighbours) and stay on that replica while it has room within the fair share
    ``(sum(loads) + sum(costs)) / len(loads)``. The member that would overflow it moves the
    rest of the group to the then least-loaded replica: a cut costs one more prefill of the
    shared blocks, an overfull replica keeps everyone waiting. So no replica ends with more
    than ``max(max(loads), fair share + max(costs))``.
    """
    if not loads:
        raise ValueError("assign_replicas needs at least one replica.")
    share = (sum(loads) + sum(costs)) / len(loads)
    groups: dict[tuple[int, ...] | int, list[int]] = defaultdict(list)
    for index, tokens in enumerate(prompts):
        key = tuple(tokens[:block_size]) if len(tokens) >= block_size else index
        groups[key].append(index)
    ordered = sorted(
        groups.values(), key=lambda members: (-sum(costs[i] for i in members), members[0])
    )
    replica_loads = list(loads)
    assignment = [-1] * len(prompts)
    for members in ordered:
        replica: int | None = None
        for index in sorted(members, key=lambda i: prompts[i]):
            if replica is None or replica_loads[replica] + costs[index] > share:
                replica = min(range(len(replica_loads)), key=replica_loads.__getitem__)
            replica_loads[replica] += costs[index]
            assignment[index] = replica
    return assignment


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """Where one replica runs: the cores it may use, and the environment it sets before
    anything initializes CUDA."""

    cpus: tuple[int, ...]
    environment: dict[str, str]


def place_replicas(
    num_replicas: int,
    tensor_parallel_size: int,
    cpus: Sequence[int],
    cuda_devices: Sequence[str] | None,
) -> list[ReplicaPlacement]:
    """Replica r gets the r-th of ``num_replicas`` equal slices of ``cpus`` (at least one
    core; with fewer cores than replicas they are shared round the list), and, on CUDA,
    devices ``r*tp .. r*tp+tp-1`` of ``cuda_devices`` as its ``CUDA_VISIBLE_DEVICES``.

    The replica's tensor-parallel ranks inherit both, so they split its cores among
    themselves and see its devices as cuda:0 .., and need not know they are a replica.
    """
    share = max(1, len(cpus) // num_replicas)
    tp = tensor_parallel_size
    return [
        ReplicaPlacement(
            cpus=tuple(cpus[(r * share + i) % len(cpus)] for i in range(share)),
            environment=(
                {}
                if cuda_devices is None
                else {"CUDA_VISIBLE_DEVICES": ",".join(cuda_devices[r * tp : (r + 1) * tp])}
            ),
        )
        for r in range(num_replicas)
    ]


def _usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


# ----- the replica process ----------------------------------------------------------------


def _replica_main(
    engine_factory: Callable[[], ReplicaEngine],
    placement: ReplicaPlacement,
    commands: connection.Connection,
    results: connection.Connection,
) -> None:
    """A replica process: build the engine, then serve commands until "stop" or the front
    goes away."""
    # NOTE: before the engine exists, so CUDA (initialized lazily) sees only our devices.
    os.environ.update(placement.environment)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(len(placement.cpus))
    # terminate() then still runs the finally below, which ends tensor-parallel workers; a
    # Ctrl-C (sent to the whole process group) is the front's to handle, by stopping us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = engine_factory()
    except Exception as error:
        _send_failure(results, error)
        sys.exit(1)
    try:
        results.send(("ready", engine.get_metrics()))
        inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(target=_read_commands, args=(commands, inbox), daemon=True).start()
        _serve(engine, inbox, results)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front is gone; nobody to report to
    except Exception as error:
        _send_failure(results, error)
        raise
    finally:
        engine.shutdown()


def _read_commands(commands: connection.Connection, inbox: queue.Queue[tuple[str, Any]]) -> None:
    while True:
        try:
            inbox.put(commands.recv())
        except (EOFError, OSError):
            inbox.put(("stop", None))  # the front is gone: end too, leave no orphan
            return


def _serve(
    engine: ReplicaEngine, inbox: queue.Queue[tuple[str, Any]], results: connection.Connection
) -> None:
    while True:
        # Idle: wait for a command. Busy: take the commands that have come, then step.
        pending = [] if engine.has_unfinished() else [inbox.get()]
        while not inbox.empty():
            pending.append(inbox.get())
        for command, payload in pending:
            if command == "stop":
                return
            if command == "add":
                for request in payload:
                    engine.add_request(
                        request.request_id,
                        request.prompt,
                        request.prompt_token_ids,
                        request.params,
                        request.bad_words_token_ids,
                    )
            elif command == "abort":
                engine.abort_all()
            elif command == "metrics":
                results.send(("metrics", engine.get_metrics()))
        if engine.has_unfinished():
            for output in engine.step():
                results.send(("output", output))


def _send_failure(results: connection.Connection, error: BaseException) -> None:
    # NOTE: a round trip, not just dumps: an exception whose __init__ takes other arguments
    # than its message pickles, and then fails to unpickle in the front.
    try:
        pickle.loads(pickle.dumps(error))
        exception: BaseException | None = error
    except Exception:
        exception = None
    with contextlib.suppress(OSError):  # the front may be gone
        results.send(("failed", ReplicaFailure(traceback.format_exc(), exception)))


# ----- the front --------------------------------------------------------------------------


@dataclass(eq=False)
class _Replica:
    """The front's view of one replica process."""

    rank: int
    process: BaseProcess
    commands: connection.Connection
    results: connection.Connection
    metrics: EngineMetrics | None = None  # the last reported; kept after the replica ends
    metrics_pending: bool = False
    failure: ReplicaFailure | None = None
    alive: bool = True
    outstanding: dict[str, ReplicaRequest] = field(default_factory=dict)

    @property
    def load(self) -> int:
        return sum(request.cost for request in self.outstanding.values())

    def send(self, message: tuple[str, Any]) -> None:
        # A send to a replica that died fails; its sentinel says so, and its outstanding
        # requests then run elsewhere.
        with contextlib.suppress(OSError):
            self.commands.send(message)

    def cause(self) -> str:
        """Why the process ended, in words."""
        code = self.process.exitcode
        if self.failure is not None:
            return f"exit code {code} after {self.failure.summary}"
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"


class DataParallelEngine:
    """``num_replicas`` engines in their own processes, driven like one `LLMEngine`.

    ``engine_factory`` builds one replica's engine inside its process (it is pickled: a
    module-level function or a `functools.partial` of one). Each replica runs on its own
    ``cores // num_replicas`` cores with as many torch threads and, on CUDA, on its own
    ``tensor_parallel_size`` devices (`place_replicas`).

    A request without a seed of its own gets the seed a single engine would have drawn for
    it (from ``seed`` and its arrival number), so outputs do not depend on the number of
    replicas or on which replica runs what. When a replica dies, its unfinished requests run
    again on the others; when none is left, `step` raises `ReplicasLostError`.
    """

    def __init__(
        self,
        engine_factory: Callable[[], ReplicaEngine],
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
        self._finished: list[RequestOutput] = []
        self._lost: list[str] = []
        self._losses: list[str] = []
        context = torch.multiprocessing.get_context("spawn")
        placements = place_replicas(
            num_replicas,
            tensor_parallel_size,
            _usable_cpus(),
            devices,
        )
        self._replicas: list[_Replica] = []
        # Stops every replica when this engine is shut down, collected, or at exit.
        self._finalizer = weakref.finalize(self, _stop_replicas, self._replicas)
        for rank, placement in enumerate(placements):
            commands_out, commands_in = context.Pipe(duplex=False)
            results_out, results_in = context.Pipe(duplex=False)
            process = context.Process(
                target=_replica_main,
                args=(engine_factory, placement, commands_out, results_in),
                name=f"paged_llm-dp-replica-{rank}",
            )
            process.start()
            # NOTE: the child's ends close here, so a dead child reads as EOF, not silence.
            commands_out.close()
            results_in.close()
            self._replicas.append(_Replica(rank, process, commands_in, results_out))
        self._wait_until_started()

    @property
    def num_live_replicas(self) -> int:
        return sum(replica.alive for replica in self._replicas)

    @property
    def replica_pids(self) -> list[int | None]:
        """Process ids of the replicas, in rank order (for monitoring and tests)."""
        return [replica.process.pid for replica in self._replicas]

    def _wait_until_started(self) -> None:
        while all(replica.alive for replica in self._replicas) and any(
            replica.metrics is None for replica in self._replicas
        ):
            self._wait_for_events()
        failed = next((replica for replica in self._replicas if not replica.alive), None)
        if failed is None:
            return
        self.shutdown()
        message = f"Data-parallel replica {failed.rank} failed to start ({failed.cause()})"
        if failed.failure is None:
            raise RuntimeError(message + ".")
        if failed.failure.exception is not None:
            raise failed.failure.exception from RuntimeError(
                f"{message}:\n{failed.failure.traceback}"
            )
        raise RuntimeError(f"{message}:\n{failed.failure.traceback}")

    # ----- the engine interface -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> None:
        """Queue a validated request; the next `step` sends it to a replica."""
        params = resolve_seed(params, self._seed, self._num_requests)
        self._num_requests += 1
        cost = request_cost(len(prompt_token_ids), params, self._max_model_len)
        self._pending.append(
            ReplicaRequest(request_id, prompt, prompt_token_ids, params, bad_words_token_ids, cost)
        )

    def has_unfinished(self) -> bool:
        return bool(
            self._pending
            or self._finished
            or self._lost
            or any(replica.outstanding for replica in self._replicas)
        )

    def step(self) -> list[RequestOutput]:
        """Send queued requests out, then wait for at least one to finish; return those that
        have. Raises `ReplicasLostError` for requests no replica is left to run."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._dispatch(pending)
        while not (self._finished or self._lost) and self._has_outstanding():
            self._wait_for_events()
        if self._finished:
            finished, self._finished = self._finished, []
            return finished
        if self._lost:
            lost, self._lost = self._lost, []
            raise ReplicasLostError(
                f"{len(lost)} request(s) could not finish: no data-parallel replica is left "
                f"to run them. Lost: {'; '.join(self._losses)}.",
                lost,
            )
        return []

    def abort_all(self) -> None:
        """Drop every unfinished request; outputs of aborted requests that still arrive are
        ignored (request ids are never reused)."""
        self._pending.clear()
        self._finished.clear()
        self._lost.clear()
        for replica in self._replicas:
            if replica.alive:
                replica.outstanding.clear()
                replica.send(("abort", None))

    def get_metrics(self) -> EngineMetrics:
        """The replicas' counters, summed; a replica that ended counts with its last report.
        A request that ran again after its replica died counts on both."""
        live = [replica for replica in self._replicas if replica.alive]
        for replica in live:
            replica.metrics_pending = True
            replica.send(("metrics", None))
        while any(replica.alive and replica.metrics_pending for replica in live):
            self._wait_for_events()
        reports = [astuple(r.metrics) for r in self._replicas if r.metrics is not None]
        return EngineMetrics(*(sum(column) for column in zip(*reports, strict=True)))

    def shutdown(self) -> None:
        """End every replica process: ask, then terminate, then kill; join them all."""
        self._finalizer()

    # ----- the front's event loop ---------------------------------------------------------

    def _has_outstanding(self) -> bool:
        return any(replica.outstanding for replica in self._replicas)

    def _dispatch(self, requests: list[ReplicaRequest]) -> None:
        live = [replica for replica in self._replicas if replica.alive]
        if not live:
            self._lost.extend(request.request_id for request in requests)
            return
        assignment = assign_replicas(
            [request.prompt_token_ids for request in requests],
            [request.cost for request in requests],
            [replica.load for replica in live],
            self._block_size,
        )
        batches: dict[int, list[ReplicaRequest]] = defaultdict(list)
        for request, position in zip(requests, assignment, strict=True):
            batches[position].append(request)
        for position, batch in batches.items():
            replica = live[position]
            # NOTE: outstanding before sending: if the send fails, the replica's death
            # (noticed on its sentinel) reruns the batch elsewhere.
            replica.outstanding.update((request.request_id, request) for request in batch)
            replica.send(("add", batch))

    def _wait_for_events(self) -> None:
        """Block until a live replica sends something or ends, and handle it."""
        live = [replica for replica in self._replicas if replica.alive]
        ready = set(
            connection.wait(
                [replica.results for replica in live]
                + [replica.process.sentinel for replica in live]
            )
        )
        for replica in live:
            if replica.results in ready:
                self._receive(replica)
            if replica.alive and replica.process.sentinel in ready:
                # What it sent before it ended still counts.
                self._receive(replica)
                if replica.alive:
                    self._lose(replica)

    def _receive(self, replica: _Replica) -> None:
        """Handle every message waiting from ``replica``; at end of file it has ended."""
        try:
            while replica.results.poll():
                kind, payload = replica.results.recv()
                if kind == "output":
                    if replica.outstanding.pop(payload.request_id, None) is not None:
                        self._finished.append(payload)
                elif kind in ("ready", "metrics"):
                    replica.metrics = payload
                    replica.metrics_pending = False
                elif kind == "failed":
                    replica.failure = payload
        except (EOFError, OSError):
            self._lose(replica)

    def _lose(self, replica: _Replica) -> None:
        """``replica`` has ended: record why, and run its unfinished requests elsewhere."""
        replica.alive = False
        replica.process.join(TERMINATE_TIMEOUT_S)
        if replica.process.is_alive():  # it closed its pipe but lingers: make sure
            replica.process.kill()
            replica.process.join()
        cause = replica.cause()
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
            f"\n{replica.failure.traceback}" if replica.failure is not None else "",
        )
        if orphans:
            self._dispatch(orphans)


def _stop_replicas(replicas: list[_Replica]) -> None:
    """Ask each replica to stop; terminate, then kill, what is still running; join all."""
    for replica in replicas:
        if replica.process.is_alive():
            replica.send(("stop", None))
    for timeout, end in (
        (STOP_TIMEOUT_S, BaseProcess.terminate),
        (TERMINATE_TIMEOUT_S, BaseProcess.kill),
    ):
        deadline = time.monotonic() + timeout
        for replica in replicas:
            replica.process.join(max(0.0, deadline - time.monotonic()))
            if replica.process.is_alive():
                end(replica.process)
    for replica in replicas:
        replica.process.join()
        replica.alive = False
        replica.commands.close()
        replica.results.close()
