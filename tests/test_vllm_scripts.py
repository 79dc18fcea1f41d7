"""Scripts written for vLLM run with `vllm` resolving to `paged_llm` and nothing else changed
(tests/vllm_scripts/), and give the values vLLM's contract promises: greedy tokens equal to
transformers', the `LLMEngine` loop's outputs equal to `LLM.generate`'s, answers that the
prefix cache leaves unchanged."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_llm import LLM, EngineArgs, RequestOutput, SamplingParams
from paged_llm.lora.request import LoRARequest
from paged_llm.sampling_params import RequestOutputKind
from tests.conftest import hf_greedy, peft_greedy, write_peft_adapter
from tests.vllm_scripts.runner import run_script

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_basic_generates_well_formed_samples(model: str, one_thread: None) -> None:
    outputs = run_script("basic.py", model)["outputs"]
    assert [output.prompt for output in outputs] == [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    for output in outputs:
        (completion,) = output.outputs
        assert output.finished and completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= 16  # vLLM's default max_tokens


def test_the_llm_engine_loop_gives_what_generate_gives(model: str, one_thread: None) -> None:
    run = run_script(
        "llm_engine_example.py", "--model", model, "--max_model_len=128", "--seed", "3"
    )
    finished = run["finished"]
    assert sorted(output.request_id for output in finished) == ["0", "1", "2"]
    by_id = {output.request_id: output for output in finished}
    # The script's own prompts and params, run through LLM.generate instead.
    prompts_and_params = run["create_test_prompts"]()
    with LLM(model, max_model_len=128, seed=3) as llm:
        expected = llm.generate(
            [prompt for prompt, _ in prompts_and_params],
            [params for _, params in prompts_and_params],
        )
    for index, want in enumerate(expected):
        got = by_id[str(index)]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    greedy, reference = by_id["0"], expected[0]
    assert greedy.prompt_logprobs == reference.prompt_logprobs
    assert greedy.outputs[0].logprobs == reference.outputs[0].logprobs


def test_greedy_tokens_of_a_script_equal_transformers(model: str, one_thread: None) -> None:
    outputs = run_script("prefix_caching.py", model)
    assert outputs["generated_same"] is True
    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for output in outputs["outputs"]:
        ids = tokenizer(output.prompt)["input_ids"]
        assert output.prompt_token_ids == ids
        assert (
            list(output.outputs[0].token_ids)
            == hf_greedy(reference, ids, 8)[: len(output.outputs[0].token_ids)]
        )


def test_reset_prefix_cache_makes_the_next_prompt_compute_anew(
    model: str, one_thread: None
) -> None:
    run = run_script("reset_prefix_cache.py", model)
    assert run["first"].num_cached_tokens == 0
    assert run["cached"].num_cached_tokens > 0
    assert run["was_reset"] is True
    assert run["after_reset"].num_cached_tokens == 0
    assert run["after_reset"].outputs[0].token_ids == run["first"].outputs[0].token_ids
    run["llm"].shutdown()


def test_reset_prefix_cache_refuses_while_requests_hold_blocks(model: str) -> None:
    with LLM(model, max_model_len=128) as llm:
        llm.llm_engine.add_request("running", "Hello there", SamplingParams(max_tokens=4))
        llm.llm_engine.step()
        assert llm.reset_prefix_cache() is False
        llm.llm_engine.abort_request("running")
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.reset_prefix_cache() is True


def test_the_multi_lora_example_runs_two_adapters_through_one_slot(
    llama_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    adapter = write_peft_adapter(
        llama_dir, tmp_path / "sql", rank=8, target_modules=["q_proj", "v_proj"], seed=0
    )
    run = run_script("multi_lora_engine.py", str(llama_dir), str(adapter))
    by_id = {output.request_id: output for output in run["finished"]}
    assert sorted(by_id) == ["0", "1", "2", "3"]
    assert [by_id[i].lora_request for i in "0123"] == [
        None,
        None,
        LoRARequest("sql-lora", 1, str(adapter)),
        LoRARequest("sql-lora2", 2, str(adapter)),
    ]
    prompts = [by_id[i].prompt_token_ids for i in "023"]
    (base,) = peft_greedy(llama_dir, None, prompts[:1], 8)
    adapted = peft_greedy(llama_dir, adapter, prompts[1:], 8)
    assert [by_id[i].outputs[0].token_ids for i in "023"] == [base, *adapted]
    assert adapted[0] != peft_greedy(llama_dir, None, prompts[1:2], 8)[0]


def test_llm_engine_refuses_a_running_id_and_generate_waits_for_its_requests(
    model: str,
) -> None:
    with LLM(model, max_model_len=128) as llm:
        engine = llm.llm_engine
        engine.add_request("a", "Hello", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already running"):
            engine.add_request("a", "Hello again", SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="add_request"):
            llm.generate("Hi")
        assert engine.get_num_unfinished_requests() == 1
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.get_num_unfinished_requests() == 0
        assert len(llm.generate("Hi", SamplingParams(max_tokens=2))) == 1


def test_cleanup_frees_a_deleted_llms_engine(model: str) -> None:
    from paged_llm.distributed import cleanup_dist_env_and_memory

    llm = LLM(model, max_model_len=128)
    engine = llm.engine
    assert engine is not None
    runner = weakref.ref(engine.model_runner)  # type: ignore[attr-defined]
    del llm, engine
    cleanup_dist_env_and_memory()
    gc.collect()
    assert runner() is None


def test_engine_args_build_the_engine_llm_builds(model: str) -> None:
    from paged_llm import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_model_len=64))
    try:
        assert engine.model_config.max_model_len == 64
        assert engine.get_tokenizer() is engine.tokenizer
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("x", "Hi", SamplingParams())
    with pytest.raises(ValueError, match="stat_loggers"):
        LLMEngine.from_engine_args(EngineArgs(model=model), stat_loggers=[object()])


def test_a_custom_logits_processor_class_forces_only_the_requests_that_ask(
    model: str, one_thread: None
) -> None:
    outputs = run_script("logits_processor_custom.py", model)["outputs"]
    assert set(outputs[0].outputs[0].token_ids) == {128}
    assert set(outputs[2].outputs[0].token_ids) == {67}
    with LLM(model, max_model_len=128) as plain:
        free = plain.generate(
            [outputs[1].prompt, outputs[3].prompt], SamplingParams(temperature=0.0)
        )
    assert [o.outputs[0].token_ids for o in (outputs[1], outputs[3])] == [
        o.outputs[0].token_ids for o in free
    ]


def test_the_metrics_example_counts_the_tokens_it_processed(model: str, one_thread: None) -> None:
    run = run_script("metrics.py", model)
    outputs, seen = run["outputs"], run["seen"]
    (prompt_tokens,) = seen["vllm:prompt_tokens"]
    (generation_tokens,) = seen["vllm:generation_tokens"]
    assert prompt_tokens.value == sum(len(o.prompt_token_ids) for o in outputs)
    assert generation_tokens.value == sum(len(o.outputs[0].token_ids) for o in outputs)
    (ttft,) = seen["vllm:time_to_first_token_seconds"]
    assert ttft.count == len(outputs) and ttft.buckets["+Inf"] == len(outputs)
    (running,) = seen["vllm:num_requests_running"]
    assert running.value == 0


def test_step_reports_as_each_requests_output_kind_asks(model: str, one_thread: None) -> None:
    prompt = "Once upon a time"
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
    kinds = {
        "cumulative": RequestOutputKind.CUMULATIVE,
        "delta": RequestOutputKind.DELTA,
        "final": RequestOutputKind.FINAL_ONLY,
    }
    with LLM(model, max_model_len=128, max_num_seqs=2) as llm:
        (expected,) = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)
        engine = llm.llm_engine
        for request_id, kind in kinds.items():
            engine.add_request(request_id, prompt, SamplingParams(**greedy, output_kind=kind))
        reports: dict[str, list[RequestOutput]] = {request_id: [] for request_id in kinds}
        while engine.has_unfinished_requests():
            for output in engine.step():
                reports[output.request_id].append(output)
    want = expected.outputs[0]
    for outputs in reports.values():
        assert [o.finished for o in outputs][-1] is True
        assert not any(o.finished for o in outputs[:-1])
    (final,) = reports["final"]
    assert final.outputs[0].token_ids == want.token_ids and final.outputs[0].text == want.text
    cumulative = [o.outputs[0] for o in reports["cumulative"]]
    assert [len(c.token_ids) for c in cumulative] == list(range(1, 7))
    assert [c.token_ids for c in cumulative] == [want.token_ids[:k] for k in range(1, 7)]
    assert cumulative[-1].text == want.text and cumulative[-1].logprobs == want.logprobs
    delta = [o.outputs[0] for o in reports["delta"]]
    assert [len(d.token_ids) for d in delta] == [1] * 6
    assert [t for d in delta for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in delta) == want.text
    assert [lp for d in delta for lp in d.logprobs or []] == want.logprobs


@pytest.mark.slow
def test_the_data_parallel_launcher_runs_one_llm_per_rank(model: str) -> None:
    # NOTE: in a fresh interpreter: the script forks its ranks, and a fork of this test
    # process copies locks that the threads of earlier tests may hold (it hung once so).
    runner = (
        "import sys; from tests.vllm_scripts.runner import run_script; "
        "run_script('data_parallel.py', *sys.argv[1:])"
    )
    completed = subprocess.run(
        [sys.executable, "-c", runner, "--model", model, "--dp-size", "2"],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = sorted(line for line in completed.stdout.splitlines() if "DP rank" in line)
    assert lines == [
        "DP rank 0, Prompt: 'Hello, my name is', Generated tokens: 4",
        "DP rank 0, Prompt: 'The president of the United States is', Generated tokens: 4",
        "DP rank 1, Prompt: 'The capital of France is', Generated tokens: 6",
        "DP rank 1, Prompt: 'The future of AI is', Generated tokens: 6",
    ]
