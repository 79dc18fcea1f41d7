"""compressed-tensors checkpoints: made by the compressed-tensors library itself from a
tiny random-weight Llama (min-max scales, `benchmarks.compressed_checkpoint`), and read
back by transformers' compressed-tensors quantizer (which decompresses with the library)
as the reference.

Our logits must match the reference far more closely than the format's own rounding moves
them; greedy tokens must equal the reference's, on one rank and on two.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

pytest.importorskip("compressed_tensors")

from benchmarks.compressed_checkpoint import write_compressed_checkpoint
from paged_llm import LLM, SamplingParams
from paged_llm.layers.quantization.checkpoint_formats import resolve_quantization
from tests.conftest import TINY_BASE_CONFIG, hf_greedy
from tests.layers.quantization.activation_rounding import PROJECTIONS, round_inputs_of
from tests.models.test_parity import MAX_TOKENS as SCENARIO_MAX_TOKENS
from tests.models.test_parity import (
    SCENARIO_GROUPS,
    _prompts,
    _shared_prefix_prompts,
    check_scenario,
    generate_greedy,
    group_settings,
)

# name -> (bits, symmetric, group size or None for per channel, compression format).
SCHEMES: dict[str, tuple[int, bool, int | None, str]] = {
    "w4-group32-asym-packed": (4, False, 32, "pack-quantized"),
    "w8-channel-asym-naive": (8, False, None, "naive-quantized"),
    "w4-channel-sym-packed": (4, True, None, "pack-quantized"),
    "w8-group32-sym-packed": (8, True, 32, "pack-quantized"),
}
# Between them the first two cover both widths, both scale layouts, zero points and both
# formats (about 10 s each); the symmetric variants run in the slow run.
DEFAULT_RUN_SCHEMES = ("w4-group32-asym-packed", "w8-channel-asym-naive")
NUM_PROMPTS, MAX_TOKENS = 4, 12


def compress_with_the_library(model_dir: Path, scheme: str, out: Path) -> None:
    bits, symmetric, group_size, compression = SCHEMES[scheme]
    write_compressed_checkpoint(model_dir, out, bits, symmetric, group_size, compression)


def transformers_reference(model_dir: Path, scheme: str) -> transformers.PreTrainedModel:
    """transformers' own loading of ``scheme``'s checkpoint, decompressed to float weights,
    with the projections' inputs rounded as paged_llm's CPU kernels round them."""
    config = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=config
    )
    return round_inputs_of(model, PROJECTIONS, SCHEMES[scheme][2]).eval()


@pytest.fixture(scope="module")
def compressed_model_dir(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = tmp_path_factory.mktemp(scheme)
            compress_with_the_library(llama_dir, scheme, made[scheme])
        return made[scheme]

    return make


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Our log-probability of each prompt token after the first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert output.prompt_logprobs is not None
    rows = output.prompt_logprobs[1:]
    return torch.tensor([row[token].logprob for row, token in zip(rows, prompt[1:], strict=True)])


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def reference_logprobs(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    "scheme",
    [
        pytest.param(name, marks=() if name in DEFAULT_RUN_SCHEMES else pytest.mark.slow)
        for name in SCHEMES
    ],
)
def test_logits_and_greedy_tokens_match_transformers_loading_the_checkpoint(
    scheme: str,
    compressed_model_dir: Callable[[str], Path],
    llama_dir: Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    path = compressed_model_dir(scheme)
    reference = transformers_reference(path, scheme)
    float_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    prompts = _prompts(tokenizer)[:NUM_PROMPTS]
    prompt = prompts[1][:48]
    # quantization=None picks the format up from config.json, as in vLLM.
    with LLM(path, max_model_len=256) as llm:
        ours = prompt_logprobs(llm, prompt)
        tokens = greedy_tokens(llm, prompts)
    assert tokens == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    wanted = reference_logprobs(reference, prompt)
    # The tolerance is set from the reference's own rounding: quantizing the float weights
    # moves these log-probabilities by 0.8-12 (measured, random weights of std 0.5); we
    # may differ from the reference by a ten-thousandth of that (float32 summation order,
    # and code * scale + offset for (code - zero) * scale: measured 0-3e-5).
    # With the activations rounded to int8 (both sides), a value one float32 ulp apart on
    # the two sides can round to codes one apart, and the step reaches the positions after
    # it through attention: measured up to 0.07 (a twentieth of the weights' rounding) at
    # up to a fifth of the positions. The median stays within the float32 bound.
    rounding = (reference_logprobs(float_model, prompt) - wanted).abs().max().item()
    assert rounding > 0.1, "the scheme's rounding should be visible in the logits"
    differences = (ours - wanted).abs()
    assert differences.median().item() < rounding / 10_000
    assert differences.max().item() < rounding / 10


@pytest.mark.slow  # two rank processes: about 15 s
def test_two_ranks_split_codes_scales_and_zero_points(
    compressed_model_dir: Callable[[str], Path],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    """Each rank keeps its rows (q/k/v, gate/up) or its whole groups of columns (o, down)
    of the codes and of their scales and zero points; per channel, its columns of one
    group per row."""
    prompts = _prompts(tokenizer)[:NUM_PROMPTS]
    for scheme in DEFAULT_RUN_SCHEMES:
        path = compressed_model_dir(scheme)
        reference = transformers_reference(path, scheme)
        expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
        settings = {"quantization": "compressed-tensors", "tensor_parallel_size": 2}
        with LLM(path, max_model_len=256, **settings) as llm:
            assert greedy_tokens(llm, prompts) == expected


@pytest.mark.slow  # the parity scenarios' 11 prompts: about 20 s
@pytest.mark.parametrize("group", ["chunked-prefill+preemption", "prefix-hits"])
def test_the_quantized_path_keeps_chunking_preemption_and_prefix_hits(
    group: str,
    compressed_model_dir: Callable[[str], Path],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    scheme = "w4-group32-asym-packed"
    path = compressed_model_dir(scheme)
    settings, shared_prefix = group_settings(path, group)
    prompts = _shared_prefix_prompts(tokenizer) if shared_prefix else _prompts(tokenizer)
    reference = transformers_reference(path, scheme)
    expected = [
        hf_greedy(reference, p, n) for p, n in zip(prompts, SCENARIO_MAX_TOKENS, strict=True)
    ]
    with LLM(path, **settings) as llm:
        outputs, metrics = generate_greedy(llm, prompts)
    for scenario in SCENARIO_GROUPS[group]:
        check_scenario(scenario, outputs, metrics, expected)


def test_a_conflicting_quantization_argument_is_refused(
    compressed_model_dir: Callable[[str], Path],
) -> None:
    with pytest.raises(ValueError, match=r"quantization='int8' conflicts.*'compressed-tensors'"):
        LLM(compressed_model_dir("w4-channel-sym-packed"), quantization="int8")


def _config(**group: Any) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    weights["group_size"] = 32
    scheme = {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
    scheme.update({key: value for key, value in group.items() if key != "weights"})
    weights.update(group.get("weights", {}))
    return {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": scheme},
        "ignore": ["lm_head"],
    }


def _hf_config(quantization_config: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        quantization_config=quantization_config,
        num_hidden_layers=TINY_BASE_CONFIG["num_hidden_layers"],
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (_config(input_activations={"num_bits": 8, "type": "int"}), "input_activations"),
        (_config(weights={"type": "float", "num_bits": 8}), "float weights of 8 bits"),
        (_config(weights={"actorder": "group"}), "act-order"),
        (_config(weights={"num_bits": 2}), "2-bit weights"),
        (_config(weights={"strategy": "tensor"}), "'tensor' weight strategy"),
        (_config(format="marlin-24"), "'marlin-24' format"),
        (
            {**_config(), "sparsity_config": {"format": "sparse-24-bitmask"}},
            "'sparse-24-bitmask' sparsity",
        ),
        ({**_config(), "ignore": []}, "quantized LM head"),
        ({**_config(), "ignore": ["lm_head", "re:.*down_proj"]}, "float decoder projections"),
    ],
)
def test_unsupported_schemes_are_refused_with_what_is_supported(
    config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"{named}.*it loads weight-only integer schemes"):
        resolve_quantization(None, _hf_config(config))


def test_the_checkpoint_format_needs_its_config() -> None:
    hf_config = SimpleNamespace(num_hidden_layers=1)
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quantization("compressed-tensors", hf_config)
    assert resolve_quantization(None, _hf_config(_config())) == "compressed-tensors"


def test_a_checkpoint_of_another_quant_method_is_refused_naming_the_supported_ones() -> None:
    hf_config = _hf_config({"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"'bitsandbytes'.*'compressed-tensors', 'gptq', 'awq'"):
        resolve_quantization(None, hf_config)
