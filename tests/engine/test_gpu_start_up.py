"""The GPU start-up, run on a CPU through a fake GPU platform and the real `LLM`
constructor: load -> profile one full step -> size the KV cache from what the memory
numbers leave -> build the decode graphs; then decode batches padded to a graph size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.engine import cuda_graphs, model_runner
from tests.fake_gpu import MIB, FakeGpuPlatform

# Tiny llama: 2 layers x 2 KV heads x head_dim 16 x 4 bytes, K and V, 16 tokens a block.
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16
PROMPTS = [{"prompt_token_ids": [100 + i] * (3 + 3 * i)} for i in range(5)]
MAX_TOKENS = 6


def _llm(model_dir: Path, platform: FakeGpuPlatform, **settings: object) -> LLM:
    return LLM(
        model_dir,
        device=platform,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        **settings,
    )


def _greedy(llm: LLM, prompts: list[dict] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_start_up_profiles_then_sizes_the_cache_then_builds_graphs(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    platform = FakeGpuPlatform()
    runner_class = model_runner.ModelRunner
    for method, event in [("_profile_step", "profile step"), ("_allocate_kv_cache", "allocate")]:
        original = getattr(runner_class, method)

        def recording(self, *args, _original=original, _event=event):  # type: ignore[no-untyped-def]
            platform.events.append(_event)
            return _original(self, *args)

        monkeypatch.setattr(runner_class, method, recording)
    graphs_class = cuda_graphs.DecodeGraphs

    def recording_graphs(*args, **kwargs):  # type: ignore[no-untyped-def]
        platform.events.append("graphs")
        return graphs_class(*args, **kwargs)

    monkeypatch.setattr(model_runner, "DecodeGraphs", recording_graphs)
    with _llm(llama_dir, platform) as llm:
        assert llm.engine is not None
        assert llm.engine.model_runner.decode_graphs is not None
    assert platform.events == ["reset peak", "profile step", "read peak", "allocate", "graphs"]


@pytest.mark.parametrize(
    ("utilization", "peak", "others"), [(0.9, 20 * MIB, 8 * MIB), (0.5, 3 * MIB, 1 * MIB)]
)
def test_kv_cache_gets_what_utilization_leaves_after_the_peak_and_other_processes(
    utilization: float, peak: int, others: int, llama_dir: Path
) -> None:
    platform = FakeGpuPlatform(total=64 * MIB, used_by_others=others, profiled_peak=peak)
    with _llm(llama_dir, platform, gpu_memory_utilization=utilization) as llm:
        assert llm.engine is not None
        runner = llm.engine.model_runner
        budget = int(64 * MIB * utilization) - peak - others
        assert runner.num_blocks == budget // BYTES_PER_BLOCK
        assert runner.kv_cache.numel() * runner.kv_cache.element_size() == (
            runner.num_blocks * BYTES_PER_BLOCK
        )
        assert llm.engine.block_manager.num_blocks == runner.num_blocks


def test_too_small_a_budget_fails_with_the_setting_to_raise(
    llama_dir: Path,
) -> None:
    # 64 MiB x 0.5 - 31 MiB peak - 1 MiB of others leaves nothing.
    platform = FakeGpuPlatform(total=64 * MIB, used_by_others=1 * MIB, profiled_peak=31 * MIB)
    with pytest.raises(ValueError, match=r"cannot hold one sequence.*gpu_memory_utilization"):
        _llm(llama_dir, platform, gpu_memory_utilization=0.5)


def test_a_cache_that_cannot_hold_one_sequence_fails_before_the_profile_step(
    llama_dir: Path,
) -> None:
    """A huge max_position_embeddings: nothing sized by it (the rotary table the profile
    step would build, its batch) exists before the check against the free memory."""
    platform = FakeGpuPlatform()
    with pytest.raises(
        ValueError,
        match=r"cannot hold one sequence of max_model_len=1073741824 tokens.*"
        r"gpu_memory_utilization",
    ):
        LLM(
            llama_dir,
            device=platform,
            dtype="float32",
            hf_overrides={"max_position_embeddings": 2**30},
            max_num_seqs=8,
        )
    assert platform.events == []


def test_a_kv_cache_larger_than_the_free_memory_is_refused_before_the_profile_step(
    llama_dir: Path,
) -> None:
    # 64 MiB - 8 MiB of others - 4 MiB reserved: 52 MiB free.
    platform = FakeGpuPlatform()
    with pytest.raises(
        ValueError,
        match=r"kv_cache_memory_bytes=62914560 \(0\.059 GiB\) is more than the 0\.051 GiB of "
        r"free device memory after loading the weights\. Lower kv_cache_memory_bytes to at "
        rf"most {52 * MIB}",
    ):
        _llm(llama_dir, platform, kv_cache_memory_bytes=60 * MIB)
    assert platform.events == []


@pytest.mark.parametrize(("num_prompts", "graph_size"), [(1, 1), (3, 4), (5, 8)])
def test_decode_batches_run_padded_to_the_smallest_graph_that_holds_them(
    num_prompts: int, graph_size: int, llama_dir: Path
) -> None:
    with _llm(llama_dir, FakeGpuPlatform()) as llm:
        assert llm.engine is not None
        graphs = llm.engine.model_runner.decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
        _greedy(llm, PROMPTS[:num_prompts])
        # The prompts prefill together in one (eager) step, which samples each one's first
        # token; every later token comes from a decode-only step, replayed.
        assert dict(graphs.replay_counts) == {graph_size: MAX_TOKENS - 1}


def test_greedy_tokens_are_the_same_with_graphs_on_and_off(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    with _llm(tiny_model_dir("qwen3"), FakeGpuPlatform()) as llm:
        assert llm.engine is not None and llm.engine.model_runner.decode_graphs is not None
        graphed = _greedy(llm)
    with _llm(tiny_model_dir("qwen3"), FakeGpuPlatform(), enforce_eager=True) as llm:
        assert llm.engine is not None and llm.engine.model_runner.decode_graphs is None
        eager = _greedy(llm)
    with LLM(tiny_model_dir("qwen3"), device="cpu", max_model_len=128) as llm:
        plain_cpu = _greedy(llm)
    assert graphed == eager == plain_cpu
