"""The public LLM class: input validation, ordering, lifecycle, start-up errors."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest

from paged_llm import LLM, SamplingParams

MAX_MODEL_LEN = 128


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (["fine", ""], GREEDY, r"Request 1: the prompt is empty \(0 tokens\)"),
        ([{"prompt_token_ids": []}], GREEDY, r"Request 0: the prompt is empty"),
        (
            ["fine", {"prompt_token_ids": [5] * MAX_MODEL_LEN}],
            GREEDY,
            rf"Request 1: the prompt has {MAX_MODEL_LEN} tokens, but max_model_len={MAX_MODEL_LEN} "
            rf"leaves room for at most {MAX_MODEL_LEN - 1} prompt tokens.*raise max_model_len",
        ),
        (
            [{"prompt_token_ids": [5, 49152]}],
            GREEDY,
            r"Request 0: prompt token id 49152 is outside the vocabulary \[0, 49152\)",
        ),
        ([{"prompt_token_ids": [5, -1]}], GREEDY, r"Request 0: prompt token id -1 is outside"),
        (["fine", 42], GREEDY, r"Request 1: a prompt must be a str, .* got int"),
        (
            [{"text": "no ids"}],
            GREEDY,
            r"Request 0: a prompt must be a str, .* got dict with keys \['text'\]",
        ),
        (
            [{"prompt_token_ids": "1 2 3"}],
            GREEDY,
            r"Request 0: prompt_token_ids must be a list of ints, got str",
        ),
        (["a", "b", "c"], [GREEDY, GREEDY], r"Got 2 SamplingParams for 3 prompts"),
        (["a"], [object()], r"Request 0: sampling_params must be a SamplingParams"),
        (
            ["a"],
            SamplingParams(stop_token_ids=[60000]),
            r"Request 0: SamplingParams names token id 60000, outside the vocabulary",
        ),
    ],
)
def test_bad_requests_are_rejected_before_any_work(
    llm: LLM, prompts: list, params: object, message: str
) -> None:
    before = llm.get_engine_metrics().num_requests
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_engine_metrics().num_requests == before
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, r"SamplingParams.max_tokens must be an integer >= 1"),
        ("temperature", -0.5, r"SamplingParams.temperature must be >= 0"),
    ],
)
def test_bad_sampling_values_name_the_field_and_the_request(
    llm: LLM, field: str, value: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    mutated = SamplingParams()
    setattr(mutated, field, value)
    with pytest.raises(ValueError, match=rf"Request 1: {message}"):
        llm.generate(["ok", "not ok"], [SamplingParams(), mutated], use_tqdm=False)


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": [100 + i] * (1 + 9 * i % 40)} for i in range(12)]
    params = [
        SamplingParams(temperature=0, max_tokens=1 + (7 * i) % 9, ignore_eos=True)
        for i in range(12)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    alone = [llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params, strict=True)]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]


def test_single_string_prompt_text_and_metrics(llm: LLM) -> None:
    (output,) = llm.generate("Hello there", GREEDY, use_tqdm=False)
    assert output.prompt == "Hello there"
    assert output.prompt_token_ids == llm.tokenizer("Hello there")["input_ids"]
    completion = output.outputs[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert output.finished and completion.finish_reason == "length"
    metrics = output.metrics
    assert metrics is not None
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time


def test_shutdown_frees_the_engine(llama_dir: Path) -> None:
    with LLM(llama_dir, max_model_len=64) as llm:
        runner = llm.engine.model_runner
        kv_cache = weakref.ref(runner.kv_cache)
        weights = weakref.ref(next(runner.model.parameters()))
        llm.generate("hi", GREEDY, use_tqdm=False)
    assert llm.engine is None
    gc.collect()
    assert kv_cache() is None and weights() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi")


def test_kv_cache_too_small_for_max_model_len(llama_dir: Path) -> None:
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x (K, V) = 512 bytes per token.
    with pytest.raises(
        ValueError,
        match=r"cannot hold one sequence of max_model_len=128 tokens.*"
        r"lower max_model_len to at most 32",
    ):
        LLM(llama_dir, max_model_len=128, kv_cache_memory_bytes=512 * 40)


def test_unsupported_architecture_lists_supported(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model_dir, max_model_len=64)


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("block_size", 12, r"block_size must be a power of two"),
        ("max_num_seqs", 0, r"max_num_seqs must be an integer >= 1"),
        ("max_model_len", 100_000, r"max_model_len=100000 exceeds the model's maximum"),
        ("attention_backend", "flash", r"attention_backend must be"),
        ("dtype", "int8", r"dtype must be one of"),
    ],
)
def test_bad_llm_arguments(llama_dir: Path, argument: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, **{argument: value})


def test_triton_backend_on_cpu_needs_the_interpreter(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(llama_dir, attention_backend="triton")
    # Any spelling Triton itself accepts turns it on.
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    with LLM(llama_dir, attention_backend="triton", max_model_len=64) as llm:
        assert llm.config.attention_backend == "triton"


def test_on_error_skip_reports_bad_requests_and_runs_the_rest(llm: LLM) -> None:
    bad_params = SamplingParams()
    bad_params.temperature = -1.0
    prompts = [
        "good one",
        "",
        {"prompt_token_ids": [1] * MAX_MODEL_LEN},
        "good two",
        7,
        "bad params",
    ]
    params = [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY, bad_params]
    outputs = llm.generate(prompts, params, use_tqdm=False, on_error="skip")
    assert [o.error is None for o in outputs] == [True, False, False, True, False, False]
    assert "Request 1: the prompt is empty" in outputs[1].error
    assert "max_model_len" in outputs[2].error
    assert "a prompt must be a str" in outputs[4].error
    assert "temperature" in outputs[5].error
    assert outputs[0].prompt == "good one" and len(outputs[0].outputs[0].token_ids) == 4
    assert outputs[3].prompt == "good two" and outputs[1].outputs == []
    with pytest.raises(ValueError, match="on_error must be"):
        llm.generate(["x"], GREEDY, on_error="ignore")
