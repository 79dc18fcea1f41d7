"""quantization="fp8": float8_e4m3fn weights with one float scale per output channel, made
at load time (vLLM's dynamic fp8, per channel), multiplied by csrc_triton's weight-only
kernel on CUDA.

The GPU path runs here on the fake GPU platform, with the kernel under the Triton
interpreter; the reference is transformers with every projection, the embedding and the
LM head replaced by its fp8 round trip, computed from the format's definition (scale = the
row's absmax / 448, round to nearest even, saturate at 448).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged_llm import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.fake_gpu import FakeGpuPlatform
from tests.layers.quantization.test_int8 import dequantized_reference, int8_round_trip

E4M3_MAX = 448.0
PROMPTS = [[100 + 7 * i + j for j in range(3 + 4 * i)] for i in range(3)]
MAX_TOKENS = 6


def fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """What an e4m3 weight with one absmax scale per output row stands for."""
    absmax = weight.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / E4M3_MAX, 1.0)
    codes = (weight / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale


def fp8_llm(model_dir: Path, quantize_embeddings: bool) -> LLM:
    """fp8 weights on the GPU path (the fake GPU platform: kernels under the interpreter)."""
    return LLM(
        model_dir,
        quantization="fp8",
        quantize_embeddings=quantize_embeddings,
        device=FakeGpuPlatform(),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_fp8_is_refused_on_cpu_naming_the_platform_and_the_alternative(
    llama_dir: Path,
) -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8'.*cpu platform.*'int8'"):
        LLM(llama_dir, quantization="fp8")


@pytest.mark.parametrize(
    "quantize_embeddings",
    # The interpreted kernel over the 49152-row LM head takes most of 2 minutes.
    [False, pytest.param(True, marks=pytest.mark.slow)],
)
def test_greedy_on_the_gpu_path_matches_transformers_with_fp8_weights(
    quantize_embeddings: bool, tiny_model_dir: Callable[[str], Path]
) -> None:
    """On qwen3: a tied embedding and LM head, q/k norms."""
    model_dir = tiny_model_dir("qwen3")
    reference = dequantized_reference(
        model_dir, quantize_embeddings, fp8_round_trip, cpu_activations=False
    )
    with fp8_llm(model_dir, quantize_embeddings) as llm:
        model = llm.engine.model_runner.model
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert greedy(llm) == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


def test_update_weights_requantizes_to_fp8(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """New float weights are re-quantized per row, as loading quantizes them."""
    from tests.test_training_loop import perturbed

    model_dir = tiny_model_dir("qwen3")
    new_model = perturbed(model_dir)
    new_model.save_pretrained(tmp_path)
    reference = dequantized_reference(tmp_path, False, fp8_round_trip, cpu_activations=False)
    with fp8_llm(model_dir, quantize_embeddings=False) as llm:
        llm.update_weights(new_model.named_parameters())
        assert greedy(llm) == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quantization", "round_trip"), [("fp8", fp8_round_trip), ("int8", int8_round_trip)]
)
def test_weight_only_formats_on_a_real_gpu_match_transformers_with_their_weights(
    quantization: str,
    round_trip: Callable[[torch.Tensor], torch.Tensor],
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """The compiled kernels, CUDA graphs and all, on qwen3 in float32: activations stay
    as they are on GPU, so the reference rounds the weights only."""
    model_dir = tiny_model_dir("qwen3")
    reference = dequantized_reference(model_dir, True, round_trip, cpu_activations=False)
    with LLM(model_dir, quantization=quantization, dtype="float32", max_model_len=64) as llm:
        assert greedy(llm) == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
