"""GPTQ and AWQ checkpoints: a tiny random-weight Llama's projections quantized here (4-bit
min-max with zero points), packed by reference packers written in this file from each
format's specification (not with our loader's code), and saved with the quantization_config
those tools write.

The reference is transformers running the dequantized weights ``scale * (q - zero)``:
greedy tokens must be the same, log-probabilities equal to float tolerance.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from paged_llm import LLM, SamplingParams
from paged_llm.layers.quantization.checkpoint_formats import resolve_quantization
from tests.conftest import hf_greedy
from tests.layers.quantization.activation_rounding import round_inputs_of
from tests.models.test_parity import _prompts

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BITS = 4
# AutoAWQ's packer: nibble i of a word holds output 8m + AWQ_PACK_ORDER[i].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NUM_PROMPTS, MAX_TOKENS = 4, 12

# name -> (quant_method, group size: -1 is one group per output channel, act-order: groups
# formed over a permutation of the input features, as GPTQ's desc_act makes them).
CHECKPOINTS = {
    "gptq-g32": ("gptq", 32, False),
    "gptq-per-channel": ("gptq", -1, False),
    "gptq-act-order-g32": ("gptq", 32, True),
    "awq-g32": ("awq", 32, False),
}


def quantize(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit min-max codes ``[out, in]``, float16 scales and zeros ``[out, groups]``."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    groups = weight.reshape(out_features, -1, size)
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((high - low) / (2**BITS - 1)).half()
    # NOTE: zero 0 is left out: GPTQ's v1 format stores zero - 1 and cannot hold -1.
    zero = (-low / scale.float()).round().clamp(1, 2**BITS - 1)
    codes = (groups / scale.float()[..., None] + zero[..., None]).round().clamp(0, 2**BITS - 1)
    return codes.reshape(out_features, in_features).to(torch.int64), scale, zero.to(torch.int64)


def dequantized(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    num_groups = scale.shape[1]
    groups = codes.reshape(codes.shape[0], num_groups, -1).float()
    return ((groups - zero[..., None].float()) * scale.float()[..., None]).flatten(1)


def pack_words(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """Eight 4-bit ``values`` along the last dim per int32: nibble ``i`` of word ``m`` is
    value ``8m + order[i]``."""
    eight = values.reshape(*values.shape[:-1], -1, 8)
    words = sum(eight[..., order[i]] << (BITS * i) for i in range(8))
    assert isinstance(words, torch.Tensor)
    # Two's complement: a word with its top bit set is a negative int32.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight ``[in / 8, out]`` packed along the input dim (in the
    features' own order, act-order or not), qzeros ``[groups, out / 8]`` along the output
    dim holding zero - 1 (the v1 convention), each feature's group in g_idx."""
    natural = tuple(range(8))
    return {
        "qweight": pack_words(codes, natural).T.contiguous(),
        "qzeros": pack_words((zero - 1).T.contiguous(), natural),
        "scales": scale.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight ``[in, out / 8]`` and qzeros ``[groups, out / 8]``
    packed along the output dim in its interleaved order."""
    return {
        "qweight": pack_words(codes.T.contiguous(), AWQ_PACK_ORDER),
        "qzeros": pack_words(zero.T.contiguous(), AWQ_PACK_ORDER),
        "scales": scale.T.contiguous(),
    }


PACKERS = {"gptq": gptq_tensors, "awq": awq_tensors}


def quantization_config(method: str, group_size: int, act_order: bool = False) -> dict[str, Any]:
    """What AutoGPTQ / AutoAWQ write into config.json."""
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": BITS,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }


@pytest.fixture(scope="module")
def quantized_checkpoint(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, transformers.PreTrainedModel]]:
    """``(checkpoint dir, float reference with the dequantized weights)`` of one entry of
    ``CHECKPOINTS``, from the tiny Llama."""
    made: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}

    def make(name: str) -> tuple[Path, transformers.PreTrainedModel]:
        if name in made:
            return made[name]
        method, group_size, act_order = CHECKPOINTS[name]
        source = llama_dir
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tensors: dict[str, torch.Tensor] = {}
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for module_name, module in model.named_modules():
                if module_name.rpartition(".")[2] not in _PROJECTIONS:
                    continue
                in_features = module.weight.shape[1]
                # The order groups are formed in: position i of it is in group i // size.
                order = (
                    torch.randperm(in_features, generator=generator)
                    if act_order
                    else torch.arange(in_features)
                )
                codes_in_order, scale, zero = quantize(module.weight[:, order], group_size)
                size = in_features if group_size == -1 else group_size
                codes = torch.empty_like(codes_in_order)
                codes[:, order] = codes_in_order
                g_idx = torch.empty(in_features, dtype=torch.int64)
                g_idx[order] = torch.arange(in_features) // size
                for part, tensor in PACKERS[method](codes, scale, zero, g_idx).items():
                    tensors[f"{module_name}.{part}"] = tensor
                weight = torch.empty_like(module.weight)
                weight[:, order] = dequantized(codes_in_order, scale, zero)
                module.weight.copy_(weight)
        quantized = set(tensors)
        for param_name, param in model.state_dict().items():
            if param_name.rpartition(".")[0] + ".qweight" not in quantized:
                tensors[param_name] = param.contiguous()
        path = tmp_path_factory.mktemp(name)
        save_file(tensors, path / "model.safetensors")
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = quantization_config(method, group_size, act_order)
        (path / "config.json").write_text(json.dumps(config))
        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(path)
        made[name] = (
            path,
            round_inputs_of(model, _PROJECTIONS, None if group_size == -1 else group_size).eval(),
        )
        return made[name]

    return make


def greedy_and_logprobs(
    llm: LLM, prompts: list[list[int]], prompt: list[int]
) -> tuple[list[list[int]], torch.Tensor]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (scored,) = llm.generate({"prompt_token_ids": prompt}, scoring, use_tqdm=False)
    assert scored.prompt_logprobs is not None
    rows = zip(scored.prompt_logprobs[1:], prompt[1:], strict=True)
    logprobs = torch.tensor([row[token].logprob for row, token in rows])
    return [list(o.outputs[0].token_ids) for o in outputs], logprobs


def reference_results(
    model: transformers.PreTrainedModel, prompts: list[list[int]], prompt: list[int]
) -> tuple[list[list[int]], torch.Tensor]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    tokens = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return [hf_greedy(model, p, MAX_TOKENS) for p in prompts], tokens


# The default run keeps one GPTQ case, act-order (its unpacking is the in-order one's, plus
# g_idx); in-order group 32 and per channel run in the slow one.
DEFAULT_RUN_CHECKPOINTS = ("gptq-act-order-g32", "awq-g32")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in DEFAULT_RUN_CHECKPOINTS else pytest.mark.slow)
        for n in CHECKPOINTS
    ],
)
def test_greedy_and_logprobs_match_transformers_on_the_dequantized_weights(
    name: str,
    quantized_checkpoint: Callable[[str], tuple[Path, transformers.PreTrainedModel]],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    path, reference = quantized_checkpoint(name)
    prompts = _prompts(tokenizer)[:NUM_PROMPTS]
    prompt = prompts[1][:48]
    expected_tokens, expected_logprobs = reference_results(reference, prompts, prompt)
    # quantization=None picks the method up from config.json.
    with LLM(path, max_model_len=256) as llm:
        tokens, logprobs = greedy_and_logprobs(llm, prompts, prompt)
    assert tokens == expected_tokens
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow  # two rank processes per format: about 45 s
def test_two_ranks_split_the_packed_weights_and_their_groups(
    quantized_checkpoint: Callable[[str], tuple[Path, transformers.PreTrainedModel]],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    prompts = _prompts(tokenizer)[:NUM_PROMPTS]
    for name in ("gptq-g32", "gptq-act-order-g32", "awq-g32"):
        path, reference = quantized_checkpoint(name)
        expected_tokens, _ = reference_results(reference, prompts, prompts[0])
        with LLM(path, max_model_len=256, tensor_parallel_size=2) as llm:
            tokens, _ = greedy_and_logprobs(llm, prompts, prompts[0])
        assert tokens == expected_tokens


def _hf_config(**quantization: Any) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization, num_hidden_layers=2)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({**quantization_config("gptq", 32), "bits": 3}, "3-bit weights"),
        ({**quantization_config("gptq", 32), "checkpoint_format": "marlin"}, "'marlin'"),
        ({**quantization_config("awq", 32), "version": "gemv"}, "'gemv' layout"),
        ({**quantization_config("awq", 32), "zero_point": False}, "zero_point=False"),
        (
            {**quantization_config("awq", 32), "modules_to_not_convert": ["down_proj"]},
            "float decoder projections",
        ),
    ],
)
def test_unsupported_layouts_are_refused_with_what_is_supported(
    config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"{named}.*paged_llm cannot load; it loads"):
        resolve_quantization(None, _hf_config(**config))


def test_a_conflicting_quantization_argument_is_refused() -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' conflicts.*'gptq'"):
        resolve_quantization("awq", _hf_config(**quantization_config("gptq", 32)))


def test_update_weights_refuses_a_pre_quantized_checkpoint(
    quantized_checkpoint: Callable[[str], tuple[Path, transformers.PreTrainedModel]],
) -> None:
    path, reference = quantized_checkpoint("gptq-g32")
    with (
        LLM(path, max_model_len=64) as llm,
        pytest.raises(ValueError, match=r"cannot re-quantize a pre-quantized.*'gptq'"),
    ):
        llm.update_weights(reference.named_parameters())
