"""An fp8 KV cache (``kv_cache_dtype``): its capacity, and greedy tokens equal to those of
transformers whose attention sees keys and values rounded to fp8 the same way.

fp8 is lossy, so the reference rounds too; how far fp8 moves the model from the float cache
is measured on the real SmolLM2 (tests/model_files/test_smollm2.py), not on random weights,
whose keys are large enough to saturate e4m3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from benchmarks.perplexity import perplexity, text_token_ids
from paged_llm import LLM, SamplingParams
from paged_llm.layers.attention import KV_CACHE_DTYPES
from paged_llm.model_files import DEFAULT_MODEL
from paged_llm.sampling_params import BeamSearchParams
from tests.conftest import hf_greedy
from tests.models.test_parity import (
    MAX_TOKENS,
    SCENARIO_GROUPS,
    _prompts,
    _shared_prefix_prompts,
    check_scenario,
    generate_greedy,
    group_settings,
)
from tests.test_reproducibility import check_bit_identical_however_run


def _rounded_kv_sdpa(dtype: torch.dtype) -> Callable[..., Any]:
    """Transformers' SDPA attention over keys and values rounded to ``dtype`` and back, as
    paged_llm's cache stores them (scale 1.0, saturating at the largest finite value)."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        limit = torch.finfo(dtype).max
        key, value = (x.clamp(-limit, limit).to(dtype).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    return attention


@pytest.fixture(scope="module")
def fp8_references(
    tiny_model_dir: Callable[[str], Path], tokenizer: transformers.PreTrainedTokenizerBase
) -> Callable[[str, str, bool], tuple[list[list[int]], list[list[int]]]]:
    """``get(arch, kv_cache_dtype, shared_prefix)``: the parity prompts and transformers'
    greedy tokens for them with keys and values rounded to that fp8 type."""
    cache: dict[tuple[str, str, bool], tuple[list[list[int]], list[list[int]]]] = {}

    def get(name: str, kv_cache_dtype: str, shared_prefix: bool) -> Any:
        key = (name, kv_cache_dtype, shared_prefix)
        if key not in cache:
            implementation = f"paged_llm_{kv_cache_dtype}"
            dtype = KV_CACHE_DTYPES[kv_cache_dtype]
            assert dtype is not None
            AttentionInterface.register(implementation, _rounded_kv_sdpa(dtype))
            # NOTE: without a mask function of its own, transformers builds no mask for an
            # implementation it does not know (no sliding window).
            ALL_MASK_ATTENTION_FUNCTIONS.register(implementation, sdpa_mask)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32, attn_implementation=implementation
            ).eval()
            prompts = _shared_prefix_prompts(tokenizer) if shared_prefix else _prompts(tokenizer)
            expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
            cache[key] = (prompts, expected)
        return cache[key]

    return get


@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype", "group", "attention_backend"),
    [
        ("llama", "fp8", "chunked-prefill+preemption", "cpu"),
        pytest.param("llama", "fp8", "chunked-prefill+preemption", "torch", marks=pytest.mark.slow),
        pytest.param("mistral", "fp8_e4m3", "prefix-hits", "torch", marks=pytest.mark.slow),
        pytest.param("llama3-tied", "fp8_e5m2", "default", "torch", marks=pytest.mark.slow),
        pytest.param("qwen3", "fp8", "prefix-hits", "torch", marks=pytest.mark.slow),
        # Under the Triton interpreter on CPU: tens of seconds.
        pytest.param("llama", "fp8", "prefix-hits", "triton", marks=pytest.mark.slow),
        pytest.param(
            "mistral", "fp8_e5m2", "chunked-prefill+preemption", "triton", marks=pytest.mark.slow
        ),
    ],
)
def test_fp8_greedy_matches_transformers_over_fp8_rounded_kv(
    arch: str,
    kv_cache_dtype: str,
    group: str,
    attention_backend: str,
    tiny_model_dir: Callable[[str], Path],
    fp8_references: Callable[[str, str, bool], tuple[list[list[int]], list[list[int]]]],
) -> None:
    """Every query, a fresh prompt's included, attends to K and V as the cache stores them,
    so chunking, prefix hits and preemption by recompute change no token."""
    settings, shared_prefix = group_settings(tiny_model_dir(arch), group)
    if "kv_cache_memory_bytes" in settings:
        # The same number of blocks (scenario_settings sizes them at 4 bytes an element).
        settings["kv_cache_memory_bytes"] //= 4
    prompts, expected = fp8_references(arch, kv_cache_dtype, shared_prefix)
    with LLM(
        tiny_model_dir(arch),
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend,
        **settings,
    ) as llm:
        outputs, metrics = generate_greedy(llm, prompts)
    for scenario in SCENARIO_GROUPS[group]:
        check_scenario(scenario, outputs, metrics, expected)


def test_the_same_memory_holds_2x_the_tokens_of_bfloat16_and_4x_of_float32_in_fp8(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The tiny llama: 2 layers x 2 KV heads x head_dim 16, K and V: 128 elements a token.
    memory = 128 * 4 * 1024
    capacity = {}
    for dtype, kv_cache_dtype in [
        ("float32", "auto"),
        ("bfloat16", "auto"),
        ("float32", "fp8"),
        ("bfloat16", "fp8_e5m2"),
    ]:
        with (
            caplog.at_level(logging.INFO, logger="paged_llm"),
            LLM(
                llama_dir,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                kv_cache_memory_bytes=memory,
                max_model_len=256,
            ) as llm,
        ):
            capacity[dtype, kv_cache_dtype] = llm.get_engine_metrics().kv_cache_capacity_tokens
    assert capacity == {
        ("float32", "auto"): 1024,
        ("bfloat16", "auto"): 2048,
        ("float32", "fp8"): 4096,
        ("bfloat16", "fp8_e5m2"): 4096,
    }
    assert "(4096 tokens, 0.00 GiB per rank, float8_e4m3fn)" in caplog.text
    assert "(2048 tokens, 0.00 GiB per rank, bfloat16)" in caplog.text
    # The start-up log also says what the weights take: each checkpoint tensor once (the
    # oneDNN-packed copies replace the dense ones).
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as checkpoint:
        elements = sum(checkpoint.get_tensor(name).numel() for name in checkpoint.keys())  # noqa: SIM118
    assert f"Weights: {4 * elements / 2**20:.1f} MiB, not quantized (float32 " in caplog.text
    assert f"Weights: {2 * elements / 2**20:.1f} MiB, not quantized (bfloat16 " in caplog.text


def test_capacity_survives_since_and_kv_cache_dtype_names_are_checked(
    llama_dir: Path,
) -> None:
    with LLM(llama_dir, max_model_len=64, kv_cache_memory_bytes=2**19) as llm:
        before = llm.get_engine_metrics()
        assert before.since(before).kv_cache_capacity_tokens == 1024
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3fn'.*'fp8_e5m2'"):
        LLM(llama_dir, kv_cache_dtype="fp8_e4m3fn")


@pytest.mark.slow
def test_fp8_kv_keeps_smollm2_perplexity_within_3_percent_and_its_top_token() -> None:
    """The real model over the fixed text: perplexity within 3% of the float32 cache's
    (measured: 34.59 against 34.65), and the most likely next token the same at most
    positions (measured: 535 of 561, 95.4%)."""
    top_tokens = {}
    perplexities = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(DEFAULT_MODEL, max_model_len=1024, kv_cache_dtype=kv_cache_dtype) as llm:
            token_ids = text_token_ids(llm)
            perplexities[kv_cache_dtype] = perplexity(llm, token_ids)
            (output,) = llm.generate(
                {"prompt_token_ids": token_ids},
                SamplingParams(max_tokens=1, prompt_logprobs=1),
                use_tqdm=False,
            )
        assert output.prompt_logprobs is not None
        top_tokens[kv_cache_dtype] = [
            next(t for t, logprob in position.items() if logprob.rank == 1)
            for position in output.prompt_logprobs[1:]
            if position is not None
        ]
    assert abs(perplexities["fp8"] / perplexities["auto"] - 1) < 0.03
    same = sum(a == b for a, b in zip(top_tokens["auto"], top_tokens["fp8"], strict=True))
    assert same / len(top_tokens["auto"]) > 0.93


@pytest.mark.slow
def test_fp8_greedy_on_two_ranks_matches_transformers_over_fp8_rounded_kv(
    llama_dir: Path,
    fp8_references: Callable[[str, str, bool], tuple[list[list[int]], list[list[int]]]],
) -> None:
    """Each rank stores its own KV heads in fp8; the tokens are those of one process."""
    model_dir = llama_dir
    settings, shared_prefix = group_settings(model_dir, "chunked-prefill+preemption")
    # The same blocks: one byte an element (not 4), and one of the 2 KV heads per rank.
    settings["kv_cache_memory_bytes"] //= 4 * 2
    prompts, expected = fp8_references("llama", "fp8", shared_prefix)
    with LLM(model_dir, kv_cache_dtype="fp8", tensor_parallel_size=2, **settings) as llm:
        outputs, metrics = generate_greedy(llm, prompts)
    for scenario in SCENARIO_GROUPS["chunked-prefill+preemption"]:
        check_scenario(scenario, outputs, metrics, expected)


@pytest.mark.slow
def test_batch_invariant_fp8_outputs_and_logprobs_are_bit_identical_however_they_are_run(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """Rounding to fp8 is per element, so batch_invariant=True stays exact: from the prefix
    cache or not, alone or batched, chunked and preempted."""
    check_bit_identical_however_run(
        tiny_model_dir("qwen3"), kv_element_bytes=1, kv_cache_dtype="fp8"
    )


def test_beam_forks_copy_fp8_blocks_and_change_no_beam(
    llama_dir: Path,
) -> None:
    """A branching beam copies its parent's partial last block (here, fp8 bytes): the beams
    equal those of 1-token blocks, where no block is ever partial and nothing is copied."""
    prompts = [{"prompt_token_ids": [300 + 7 * i + j for j in range(5 + 3 * i)]} for i in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    beams = {}
    for block_size in (4, 1):
        with LLM(llama_dir, kv_cache_dtype="fp8", max_model_len=64, block_size=block_size) as llm:
            runner = llm.engine.model_runner
            copies: list[int] = []

            def counted(pairs: list[tuple[int, int]], copy: Any = runner._copy_blocks) -> None:
                copies.append(len(pairs))  # noqa: B023 - used within this iteration only
                copy(pairs)

            runner._copy_blocks = counted  # type: ignore[method-assign]
            outputs = llm.beam_search(prompts, params)
            beams[block_size] = [[seq.tokens for seq in o.sequences] for o in outputs]
        assert bool(copies) == (block_size > 1)
    assert beams[4] == beams[1]
