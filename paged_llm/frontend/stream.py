"""Results as they finish: one loop over the engine for every entry point, with a progress
bar, a summary line, and a guard that lets one caller at a time drive an engine."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Generic, TypeVar, cast

from tqdm.auto import tqdm

from paged_llm.engine.core import EngineMetrics
from paged_llm.engine.request import EngineRequest
from paged_llm.exceptions import RequestError
from paged_llm.frontend.engine_client import EngineClient, RequestsLostError
from paged_llm.frontend.input_processor import ProcessedRequest, RejectedRequest
from paged_llm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

# What a stream's requests produce: generations or pooling outputs.
OutputT = TypeVar("OutputT", RequestOutput, PoolingRequestOutput[PoolingOutput])
ProgressBar = bool | Callable[..., tqdm]


class GenerationLock:
    """One generation at a time per engine: the engine's batch belongs to one caller.

    Held from a stream's first step to its end (finished, closed, broken out of or
    garbage), never blocking: a second caller gets a RuntimeError that says who holds it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> None:
        if not self._lock.acquire(blocking=False):
            if self._owner == threading.get_ident():
                holder = (
                    "an unfinished generate_stream of this LLM holds it; finish iterating it "
                    "or close() it first"
                )
            else:
                holder = (
                    "another thread is generating with it; an LLM runs one generation at a "
                    "time, so wait for that call to return or give each thread its own LLM"
                )
            raise RuntimeError(f"Another generation is still running on this LLM: {holder}.")
        self._owner = threading.get_ident()

    def release(self) -> None:
        self._owner = None
        self._lock.release()


class GenerationStream(Generic[OutputT]):
    """Iterates ``(input_index, RequestOutput)`` (for pooling requests their
    `PoolingRequestOutput`) in completion order while the engine runs; see
    `LLM.generate_stream`. A request refused under ``on_error="skip"`` comes as
    an output whose ``error`` is its `RequestError`'s text; `results` gives the error
    itself instead.

    A request that fails in the engine (its constraints leave no token to generate) is
    reported as if it had been refused: under ``skip_errors`` as its `RequestError` (with
    its index) while the others run on; otherwise its `RequestError` is raised as soon as
    it fails, and the requests still running are cancelled."""

    def __init__(
        self,
        engine: EngineClient,
        requests: list[ProcessedRequest],
        lock: GenerationLock,
        use_tqdm: ProgressBar = False,
        skip_errors: bool = False,
        log_stats: bool = True,
    ) -> None:
        self.num_requests = len(requests)
        self._engine = engine
        self._requests = requests
        self._lock = lock
        self._use_tqdm = use_tqdm
        self._skip_errors = skip_errors
        self._log_stats = log_stats
        self._closed = False
        # NOTE: only a weak reference: the generator must not be kept alive by the stream
        # (nor the stream by the generator), so that leaving a loop early frees it at once
        # and its cleanup runs then, not whenever the cyclic GC gets to it.
        self._iterator: (
            weakref.ref[Generator[tuple[int, OutputT | RejectedRequest], None, None]] | None
        ) = None

    def __iter__(self) -> Iterator[tuple[int, RequestOutput | OutputT]]:
        return (
            (index, error_output(result) if isinstance(result, RejectedRequest) else result)
            for index, result in self.results()
        )

    def results(self) -> Iterator[tuple[int, OutputT | RejectedRequest]]:
        """``(input_index, RequestOutput | RejectedRequest)`` in completion order: a refused
        request as its `RejectedRequest`, whose `RequestError` names the parameter at fault
        and the reason apart."""
        if self._closed:
            return iter(())
        if self._iterator is not None:
            return self._iterator() or iter(())
        # NOTE: a stream's requests are all of one kind, so its outputs are all OutputT.
        iterator = cast(
            Generator[tuple[int, OutputT | RejectedRequest], None, None],
            _run(
                self._engine,
                self._requests,
                self._lock,
                self._use_tqdm,
                self._skip_errors,
                self._log_stats,
            ),
        )
        self._iterator = weakref.ref(iterator)
        return iterator

    def close(self) -> None:
        """Stop early: cancel this stream's requests still running. A stream closed before
        its first iteration runs nothing."""
        self._closed = True
        iterator = self._iterator() if self._iterator is not None else None
        if iterator is not None:
            iterator.close()

    def collect(self, first_index: int = 0) -> list[RequestOutput | OutputT]:
        """Every output, in input order (the requests' indices start at ``first_index``)."""
        results: list[RequestOutput | OutputT | None] = [None] * self.num_requests
        try:
            for index, output in self:
                results[index - first_index] = output
        finally:
            self.close()
        outputs = [result for result in results if result is not None]
        assert len(outputs) == self.num_requests
        return outputs


def error_output(rejected: RejectedRequest) -> RequestOutput:
    """A refused request as `LLM` reports it: no completions, ``error`` its reason."""
    return RequestOutput(
        request_id=rejected.request_id,
        prompt=rejected.prompt,
        prompt_token_ids=rejected.prompt_token_ids,
        outputs=[],
        finished=True,
        error=str(rejected.error),
        error_parameter=rejected.error.parameter,
    )


def _run(
    engine: EngineClient,
    requests: list[ProcessedRequest],
    lock: GenerationLock,
    use_tqdm: ProgressBar,
    skip_errors: bool,
    log_stats: bool,
) -> Generator[tuple[int, EngineOutput | RejectedRequest], None, None]:
    lock.acquire()
    # NOTE: from here to the release, the engine's requests are this stream's only, so the
    # cleanup's abort_all cancels nothing of another call's.
    try:
        progress = _progress_bar(
            use_tqdm,
            total=sum(_num_sequences(request) for request in requests),
        )
        metrics_before = engine.get_metrics()
        started = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        order: dict[str, int] = {}
        try:
            for index, request in enumerate(requests):
                if isinstance(request, RejectedRequest):
                    progress.update(1)
                    yield index, request
                    continue
                order[request.request_id] = index
                engine.add_request(request)
            while engine.has_unfinished():
                try:
                    outputs = engine.step()
                except RequestsLostError as error:
                    if not skip_errors:
                        raise
                    for request_id in error.request_ids:
                        index = order[request_id]
                        lost = requests[index]
                        assert isinstance(lost, EngineRequest)
                        progress.update(_num_sequences(lost))
                        yield index, _lost(lost, index, error)
                    continue
                for output in outputs:
                    num_prompt_tokens += len(output.prompt_token_ids)
                    num_outputs = 1
                    if isinstance(output, RequestOutput):
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        num_outputs = len(output.outputs)
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    progress.set_postfix_str(
                        f"est. speed input: {num_prompt_tokens / elapsed:.2f} toks/s, "
                        f"output: {num_output_tokens / elapsed:.2f} toks/s",
                        refresh=False,
                    )
                    index = order[output.request_id]
                    if output.error is not None:
                        failed = _failed(output, index)
                        if not skip_errors:
                            raise failed.error
                        progress.update(_num_sequences(requests[index]))
                        yield index, failed
                        continue
                    progress.update(num_outputs)
                    yield index, output
        finally:
            if engine.has_unfinished():
                engine.abort_all()
            progress.close()
            if log_stats:
                _log_summary(metrics_before, engine.get_metrics(), time.perf_counter() - started)
    finally:
        lock.release()


def _num_sequences(request: ProcessedRequest) -> int:
    """What a request counts for in the progress bar: its completions, or 1 if refused."""
    return 1 if isinstance(request, RejectedRequest) else request.params.n


def _failed(output: EngineOutput, index: int) -> RejectedRequest:
    """An output the engine ended with an error, as a refused request with its index."""
    assert output.error is not None
    return RejectedRequest(
        output.request_id,
        output.prompt,
        output.prompt_token_ids,
        RequestError(output.error, parameter=output.error_parameter, index=index),
    )


def _lost(request: EngineRequest, index: int, error: RequestsLostError) -> RejectedRequest:
    return RejectedRequest(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        RequestError(str(error), index=index),
    )


def _progress_bar(use_tqdm: ProgressBar, total: int) -> tqdm:
    factory = use_tqdm if callable(use_tqdm) else tqdm
    return factory(
        total=total, desc="Processed prompts", disable=use_tqdm is False, dynamic_ncols=True
    )


def _log_summary(before: EngineMetrics, after: EngineMetrics, seconds: float) -> None:
    run = after.since(before)
    if run.num_requests == 0:
        return
    logger.info(
        "Finished %d requests in %.2f s: %d prompt tokens (%.1f tok/s), %d generated tokens "
        "(%.1f tok/s); prefix-cache hit rate %.1f%%; %d preemptions.",
        run.num_requests,
        seconds,
        run.num_prompt_tokens,
        run.num_prompt_tokens / seconds,
        run.num_generated_tokens,
        run.num_generated_tokens / seconds,
        100.0 * run.prefix_cache_hit_rate,
        run.num_preemptions,
    )
