"""`LLM.get_metrics`: vLLM's metric values, measured by the engine as it runs (the buckets
and labels are unit-tested in tests/engine/test_stats.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_llm import LLM, RequestOutput, SamplingParams, StructuredOutputsParams, TokensPrompt
from paged_llm.metrics import Counter, Gauge, Histogram, Metric, Vector
from paged_llm.v1.metrics import reader

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_MODEL_LEN = 128

COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
# Observed once per completion.
PER_COMPLETION = (
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)
HISTOGRAMS = (
    *PER_COMPLETION,
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)


class Snapshot:
    """One `get_metrics` result, looked up by name (and finish reason)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics
        self.series = {(m.name, m.labels.get("finished_reason")): m for m in metrics}
        assert len(self.series) == len(metrics), "one series per name and finish reason"

    def value(self, name: str, reason: str | None = None) -> float:
        metric = self.series[name, reason]
        assert isinstance(metric, (Counter, Gauge))
        return metric.value

    def histogram(self, name: str) -> Histogram:
        metric = self.series[name, None]
        assert isinstance(metric, Histogram)
        return metric


class Run:
    """The metrics before and after one `generate`."""

    def __init__(self, before: Snapshot, after: Snapshot) -> None:
        self.before, self.after = before, after

    def count(self, name: str, reason: str | None = None) -> float:
        return self.after.value(name, reason) - self.before.value(name, reason)

    def observations(self, name: str) -> tuple[int, float]:
        """The histogram's new observations: how many, and their sum."""
        after, before = self.after.histogram(name), self.before.histogram(name)
        return after.count - before.count, after.sum - before.sum


def generate(
    llm: LLM,
    prompts: list[TokensPrompt],
    params: SamplingParams | list[SamplingParams],
    on_error: str = "raise",
) -> tuple[list[RequestOutput], Run]:
    before = Snapshot(llm.get_metrics())
    outputs = llm.generate(prompts, params, use_tqdm=False, on_error=on_error)
    return outputs, Run(before, Snapshot(llm.get_metrics()))


def prompts_of(lengths: list[int]) -> list[TokensPrompt]:
    return [
        TokensPrompt(prompt_token_ids=[300 + i + j for j in range(length)])
        for i, length in enumerate(lengths)
    ]


def test_the_vllm_example_loop_reads_every_metric_with_its_labels(llm: LLM) -> None:
    llm.generate(["Hello, my name is"], SamplingParams(max_tokens=4), use_tqdm=False)
    lines = []
    # The loop of vLLM's examples/offline_inference/metrics.py, on vLLM's import path.
    for metric in llm.get_metrics():
        if isinstance(metric, reader.Gauge):
            lines.append(f"{metric.name} (gauge) = {metric.value}")
        elif isinstance(metric, reader.Counter):
            lines.append(f"{metric.name} (counter) = {metric.value}")
        elif isinstance(metric, reader.Vector):
            lines.append(f"{metric.name} (vector) = {metric.values}")
        elif isinstance(metric, reader.Histogram):
            lines.append(f"{metric.name} (histogram) count = {metric.count}")
            lines += [f"    {bucket_le} = {value}" for bucket_le, value in metric.buckets.items()]
        assert metric.labels["model_name"] == llm.llm_engine.model_config.served_model_name
        assert metric.labels["engine"] == "0"
    metrics = llm.get_metrics()
    assert reader.Metric is Metric
    assert not any(isinstance(metric, Vector) for metric in metrics)
    kinds = {metric.name: type(metric) for metric in metrics}
    assert kinds == {
        **dict.fromkeys(COUNTERS, Counter),
        **dict.fromkeys(GAUGES, Gauge),
        **dict.fromkeys(HISTOGRAMS, Histogram),
    }
    reasons = [m.labels["finished_reason"] for m in metrics if m.name == "vllm:request_success"]
    assert reasons == ["stop", "length", "abort", "error", "repetition"]
    assert "vllm:prompt_tokens (counter) = " in "\n".join(lines)


def test_counts_are_the_tokens_and_requests_processed(llm: LLM) -> None:
    lengths, max_tokens = [5, 17, 33], [3, 6, 1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs, run = generate(llm, prompts_of(lengths), params)

    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    generated = [len(output.outputs[0].token_ids) for output in outputs]
    assert (num_prompt_tokens, generated) == (sum(lengths), max_tokens)
    assert run.count("vllm:prompt_tokens") == num_prompt_tokens
    assert run.count("vllm:generation_tokens") == sum(generated)
    assert run.count("vllm:request_success", "length") == len(outputs)
    assert run.count("vllm:request_success", "stop") == 0
    for name in PER_COMPLETION:
        assert run.observations(name)[0] == len(outputs), name
    assert run.observations("vllm:request_prompt_tokens") == (3, num_prompt_tokens)
    assert run.observations("vllm:request_generation_tokens") == (3, sum(generated))
    assert run.observations("vllm:request_params_max_tokens") == (3, sum(max_tokens))
    assert run.observations("vllm:request_max_num_generation_tokens") == (3, sum(generated))
    assert run.observations("vllm:request_params_n") == (3, 3)
    # One first token per request; every other token follows one.
    assert run.observations("vllm:time_to_first_token_seconds")[0] == len(outputs)
    assert run.observations("vllm:inter_token_latency_seconds")[0] == sum(generated) - 3
    # Each step counts the prompts it finished and the tokens it drew.
    num_steps, num_tokens = run.observations("vllm:iteration_tokens_total")
    assert num_steps >= max(max_tokens)
    assert num_tokens == num_prompt_tokens + sum(generated)


def test_each_finish_reason_is_counted(llm: LLM) -> None:
    prompt = prompts_of([9])
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (free,) = llm.generate(prompt, greedy, use_tqdm=False)
    stop_token = free.outputs[0].token_ids[1]
    stopped = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[stop_token])
    # No allowed token starts a choice: the engine fails the request when it runs.
    impossible = SamplingParams(
        max_tokens=4,
        allowed_token_ids=llm.get_tokenizer().encode(" Hello world", add_special_tokens=False),
        structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]),
    )
    outputs, run = generate(
        llm, prompt * 4, [stopped, greedy, impossible, stopped], on_error="skip"
    )
    assert [o.outputs[0].finish_reason for o in outputs if o.outputs] == ["stop", "length", "stop"]
    assert outputs[2].error is not None
    assert run.count("vllm:request_success", "stop") == 2
    assert run.count("vllm:request_success", "length") == 1
    assert run.count("vllm:request_success", "error") == 1
    assert run.count("vllm:request_success", "abort") == 0
    assert run.observations("vllm:request_generation_tokens") == (3, 2 + 4 + 2)


def test_n_counts_each_completion_and_the_request_once(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True)
    (output,), run = generate(llm, prompts_of([12]), params)
    assert run.count("vllm:request_success", "length") == 3
    generated = sum(len(completion.token_ids) for completion in output.outputs)
    assert run.count("vllm:generation_tokens") == generated == 15
    # vLLM runs the n completions as n requests, each with the prompt.
    assert run.count("vllm:prompt_tokens") == 3 * 12
    assert run.observations("vllm:time_to_first_token_seconds")[0] == 3
    assert run.observations("vllm:e2e_request_latency_seconds")[0] == 3
    assert run.observations("vllm:request_params_n") == (1, 3)
    assert run.observations("vllm:request_max_num_generation_tokens") == (1, 5)


def test_histograms_are_cumulative_and_times_add_up(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, run = generate(llm, prompts_of([20]), params)
    for name in HISTOGRAMS:
        histogram = run.after.histogram(name)
        counts = list(histogram.buckets.values())
        assert counts == sorted(counts), name
        assert list(histogram.buckets)[-1] == "+Inf"
        assert histogram.buckets["+Inf"] == histogram.count, name
        bounds = [float(bound) for bound in histogram.buckets]
        assert bounds == sorted(bounds), name
    (_, ttft), (_, e2e) = (
        run.observations("vllm:time_to_first_token_seconds"),
        run.observations("vllm:e2e_request_latency_seconds"),
    )
    (_, queue), (_, prefill), (_, decode), (_, inference) = (
        run.observations(f"vllm:request_{phase}_time_seconds")
        for phase in ("queue", "prefill", "decode", "inference")
    )
    # NOTE: the times are differences of time.time() stamps, exact to a microsecond.
    assert 0 < ttft <= e2e
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + inference <= e2e + 1e-6
    assert decode > 0
    (_, per_token) = run.observations("vllm:request_time_per_output_token_seconds")
    assert per_token == pytest.approx(decode / 7, abs=1e-6)


def test_prefix_cache_counts_agree_with_the_engine_metrics(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = prompts_of([50])
    llm.generate(prompt, params, use_tqdm=False)
    engine_before = llm.get_engine_metrics()
    _, run = generate(llm, prompt, params)
    engine_run = llm.get_engine_metrics().since(engine_before)
    assert run.count("vllm:prefix_cache_queries") == engine_run.prefix_cache_queried_tokens == 50
    # Three full blocks of 16 are cached; the last token is computed for its logits.
    assert run.count("vllm:prefix_cache_hits") == engine_run.prefix_cache_hit_tokens == 48
    assert run.count("vllm:num_preemptions") == engine_run.num_preemptions == 0


def test_gauges_are_idle_after_generate(llm: LLM) -> None:
    llm.generate(prompts_of([30, 40]), SamplingParams(max_tokens=3), use_tqdm=False)
    after = Snapshot(llm.get_metrics())
    assert after.value("vllm:num_requests_running") == 0
    assert after.value("vllm:num_requests_waiting") == 0
    assert after.value("vllm:kv_cache_usage_perc") == 0.0


def test_gauges_count_the_requests_while_they_run(llm: LLM) -> None:
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    engine.step()
    during = Snapshot(llm.get_metrics())
    assert during.value("vllm:num_requests_running") == 3
    assert 0 < during.value("vllm:kv_cache_usage_perc") < 1
    while engine.has_unfinished_requests():
        engine.step()
    assert Snapshot(llm.get_metrics()).value("vllm:num_requests_running") == 0


def test_disable_log_stats_refuses_as_vllm_does(model_dir: Path) -> None:
    with LLM(model_dir, max_model_len=MAX_MODEL_LEN, disable_log_stats=True) as quiet:
        with pytest.raises(RuntimeError, match="pass disable_log_stats=False"):
            quiet.get_metrics()
        assert quiet.get_engine_metrics().num_requests == 0
