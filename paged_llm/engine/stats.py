"""Engine statistics under the names, labels and buckets of vLLM's Prometheus metrics.

`EngineStats` counts while the engine runs: each step, the sequences that draw a token
(`EngineStats.record_step`, before `Scheduler.update` appends the tokens); each finished
request, its output (`EngineStats.record_finished`). It keeps plain ints and floats and
makes one bucket increment per observation, so nothing is allocated per token.
`EngineStats.metrics` reads them, with the scheduler's and the block manager's own counts
(requests running and waiting, the KV cache in use, preemptions, prefix-cache lookups), as
`paged_llm.metrics` values.

vLLM's unit is the request, and it runs a request with ``n > 1`` as ``n`` child requests;
here the unit is the sequence, which is the same thing. The ``n`` sequences of a request
share its times (the prompt is computed once), so each of them adds the request's intervals
to the timing histograms. The measures follow vLLM's (``vllm/v1/metrics/stats.py``):

- time to first token: arrival to the step that draws the sequence's first token;
- inter-token latency: between two consecutive tokens of a sequence (a preemption in
  between adds its recomputation);
- end-to-end: arrival to the step that finishes the request; queue: arrival to the first
  admission; prefill: first admission to first token; decode: first to last token;
  inference: first admission to last token;
- prompt tokens: a sequence's whole prompt, cached part included, counted at its first
  token; tokens per step: those prompt tokens plus the tokens drawn in the step.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence as SequenceABC
from itertools import accumulate

from paged_llm.engine.scheduler import Scheduler
from paged_llm.engine.sequence import Request, Sequence
from paged_llm.metrics import Counter, Gauge, Histogram, Metric, Vector
from paged_llm.outputs import EngineOutput, RequestOutput

# The ``finished_reason`` labels of ``vllm:request_success``, vLLM's `FinishReason`s; paged_llm
# ends requests with "stop", "length" and (a request the engine fails) "error".
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's bucket bounds: seconds to the first token, between tokens, in a request's phases.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets of token counts."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return bounds
            bounds.append(mantissa * scale)
        scale *= 10


def bucket_label(bound: float) -> str:
    """An upper bound as Prometheus writes it in a bucket's ``le`` label: the float's repr
    ("0.5", "16.0"), in exponent form from a million on ("1e+06", "1.5e+06")."""
    text = repr(float(bound))
    whole, dot, fraction = text.partition(".")
    if not dot or len(whole) <= 6:
        return text
    mantissa = f"{whole[0]}.{whole[1:]}{fraction}".rstrip("0").rstrip(".")
    return f"{mantissa}e+0{len(whole) - 1}"


class BucketCounts:
    """Observations counted per bucket and summed: ``counts[i]`` holds those in
    ``(bounds[i - 1], bounds[i]]``, the last count those above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: SequenceABC[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def histogram(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative = list(accumulate(self.counts))
        buckets = {
            bucket_label(bound): count
            for bound, count in zip(self.bounds, cumulative, strict=False)
        }
        buckets["+Inf"] = cumulative[-1]
        return Histogram(name, labels, count=cumulative[-1], sum=self.sum, buckets=buckets)


class EngineStats:
    """One engine's statistics (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        lengths = one_two_five_buckets(max_model_len)
        # In the order of vLLM's registration, which its snapshot follows.
        self.histograms = {
            name: BucketCounts(bounds)
            for name, bounds in (
                ("vllm:request_prompt_tokens", lengths),
                ("vllm:request_generation_tokens", lengths),
                ("vllm:iteration_tokens_total", ITERATION_TOKENS_BUCKETS),
                ("vllm:request_max_num_generation_tokens", lengths),
                ("vllm:request_params_n", PARAMS_N_BUCKETS),
                ("vllm:request_params_max_tokens", lengths),
                ("vllm:time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS),
                ("vllm:inter_token_latency_seconds", TOKEN_LATENCY_BUCKETS),
                ("vllm:request_time_per_output_token_seconds", TOKEN_LATENCY_BUCKETS),
                ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
                ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
                ("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS),
                ("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
                ("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS),
            )
        }
        self._iteration_tokens = self.histograms["vllm:iteration_tokens_total"]
        self._time_to_first_token = self.histograms["vllm:time_to_first_token_seconds"]
        self._inter_token_latency = self.histograms["vllm:inter_token_latency_seconds"]

    def record_step(self, sampling_seqs: list[Sequence], now: float) -> int:
        """Time the step's first and next tokens of ``sampling_seqs``; return the prompt
        tokens that the step completed, for `record_emitted`.

        Called before `Scheduler.update` appends the tokens: a sequence's output tokens and
        its request's ``last_token_time`` are still those of the steps before.
        """
        num_prompt_tokens = 0
        for seq in sampling_seqs:
            metrics = seq.request.metrics
            if seq.num_output_tokens == 0:
                num_prompt_tokens += seq.num_prompt_tokens
                self._time_to_first_token.observe(now - metrics.arrival_time)
            else:
                last_token_time = metrics.last_token_time
                assert last_token_time is not None, "a sequence with output has its time"
                self._inter_token_latency.observe(now - last_token_time)
        self.num_prompt_tokens += num_prompt_tokens
        return num_prompt_tokens

    def record_emitted(self, num_prompt_tokens: int, num_emitted: int) -> None:
        """Count the tokens the step appended (several for a sequence that speculated)."""
        self.num_generation_tokens += num_emitted
        self._iteration_tokens.observe(num_prompt_tokens + num_emitted)

    def record_finished(self, request: Request, output: EngineOutput) -> None:
        """Count a request the engine reports finished: per completion its finish reason,
        token counts and the request's intervals; per request its ``n`` and its longest
        completion. A request the engine failed (``output.error``) counts as "error"."""
        if output.error is not None:
            self.request_success["error"] += 1
            return
        if not isinstance(output, RequestOutput):
            self._record_pooling(request)
            return
        now = time.time()
        metrics = request.metrics
        arrival = metrics.arrival_time
        scheduled = metrics.first_scheduled_time
        first, last = metrics.first_token_time, metrics.last_token_time
        assert scheduled is not None and first is not None and last is not None, request
        params = request.sampling_params
        num_prompt_tokens = len(request.prompt_token_ids)
        # NOTE: vLLM fills in max_tokens=None as the room the prompt leaves.
        max_tokens = (
            params.max_tokens
            if params.max_tokens is not None
            else self.max_model_len - num_prompt_tokens
        )
        histograms = self.histograms
        for completion in output.outputs:
            assert completion.finish_reason is not None, completion
            self.request_success[completion.finish_reason] += 1
            num_generated = len(completion.token_ids)
            histograms["vllm:request_prompt_tokens"].observe(num_prompt_tokens)
            histograms["vllm:request_generation_tokens"].observe(num_generated)
            histograms["vllm:request_params_max_tokens"].observe(max_tokens)
            histograms["vllm:request_time_per_output_token_seconds"].observe(
                (last - first) / (num_generated - 1) if num_generated > 1 else 0.0
            )
            histograms["vllm:e2e_request_latency_seconds"].observe(now - arrival)
            histograms["vllm:request_queue_time_seconds"].observe(scheduled - arrival)
            histograms["vllm:request_inference_time_seconds"].observe(last - scheduled)
            histograms["vllm:request_prefill_time_seconds"].observe(first - scheduled)
            histograms["vllm:request_decode_time_seconds"].observe(last - first)
        histograms["vllm:request_params_n"].observe(params.n)
        histograms["vllm:request_max_num_generation_tokens"].observe(
            max((len(completion.token_ids) for completion in output.outputs), default=0)
        )

    def _record_pooling(self, request: Request) -> None:
        """Count a finished pooling request: its prompt, computed in the steps it ran, and
        its times up to the step that pooled it; it generates no token."""
        metrics = request.metrics
        scheduled = metrics.first_scheduled_time
        assert scheduled is not None, request
        now = time.time()
        num_prompt_tokens = len(request.prompt_token_ids)
        self.num_prompt_tokens += num_prompt_tokens
        self.request_success["stop"] += 1
        histograms = self.histograms
        histograms["vllm:request_prompt_tokens"].observe(num_prompt_tokens)
        histograms["vllm:e2e_request_latency_seconds"].observe(now - metrics.arrival_time)
        histograms["vllm:request_queue_time_seconds"].observe(scheduled - metrics.arrival_time)
        histograms["vllm:request_inference_time_seconds"].observe(now - scheduled)

    def metrics(self, model_name: str) -> list[Metric]:
        """The statistics as vLLM's snapshot lists them, labelled with ``model_name`` and
        ``engine="0"`` (a data-parallel front relabels each replica's ``engine``)."""
        scheduler = self.scheduler
        blocks = scheduler.block_manager

        def labels(**extra: str) -> dict[str, str]:
            return {"model_name": model_name, "engine": "0", **extra}

        values: list[Metric] = [
            Gauge("vllm:num_requests_running", labels(), float(len(scheduler.running))),
            Gauge(
                "vllm:num_requests_waiting",
                labels(),
                float(len(scheduler.waiting) + len(scheduler.paused)),
            ),
            Gauge(
                "vllm:kv_cache_usage_perc",
                labels(),
                1.0 - blocks.num_free_blocks / blocks.num_blocks,
            ),
            Counter("vllm:prefix_cache_queries", labels(), blocks.prefix_cache_queried_tokens),
            Counter("vllm:prefix_cache_hits", labels(), blocks.prefix_cache_hit_tokens),
            Counter("vllm:num_preemptions", labels(), scheduler.num_preemptions),
            Counter("vllm:prompt_tokens", labels(), self.num_prompt_tokens),
            Counter("vllm:generation_tokens", labels(), self.num_generation_tokens),
        ]
        values += [
            Counter("vllm:request_success", labels(finished_reason=reason), count)
            for reason, count in self.request_success.items()
        ]
        values += [counts.histogram(name, labels()) for name, counts in self.histograms.items()]
        speculator = scheduler.speculator
        if speculator is not None:
            counts = speculator.counts
            values += [
                Counter("vllm:spec_decode_num_drafts", labels(), counts.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", labels(), counts.num_draft_tokens),
                Counter(
                    "vllm:spec_decode_num_accepted_tokens", labels(), counts.num_accepted_tokens
                ),
                Vector(
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    labels(),
                    list(counts.accepted_per_position),
                ),
                Counter("vllm:spec_decode_num_emitted_tokens", labels(), counts.num_emitted_tokens),
            ]
        return values
