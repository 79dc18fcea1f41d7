"""`load_lora_adapter` / `check_lora_adapter` on adapters written by PEFT itself: the loaded
weights reproduce PEFT's own LoRA layers, and every unsupported adapter is refused by name."""

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from paged_llm.model_files import lora_adapter as lora_adapter_module
from paged_llm.model_files.lora_adapter import (
    LORA_TARGET_MODULES,
    LoRAAdapterError,
    check_lora_adapter,
    load_lora_adapter,
)

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Qwen3's head_dim (32) is not hidden_size // num_attention_heads (16): q/o shapes differ.
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**TINY),
    "qwen3": Qwen3Config(**TINY, head_dim=32),
}
MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
SAFETENSORS = "adapter_model.safetensors"
ALL_TARGETS = list(LORA_TARGET_MODULES)


def save_adapter(directory: Path, model: str = "llama", *, safe: bool = True, **lora: Any) -> Any:
    """A tiny random `model` wrapped by PEFT with random (non-zero) A and B, saved to
    ``directory``; returns the PeftModel."""
    torch.manual_seed(0)
    base = MODEL_CLASSES[model](CONFIGS[model])
    options: dict[str, Any] = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "init_lora_weights": False,
    }
    config = peft.LoraConfig(**{**options, **lora})
    wrapped = peft.get_peft_model(base, config).eval()
    wrapped.save_pretrained(directory, safe_serialization=safe)
    return wrapped


def lora_modules(wrapped: Any) -> dict[str, Any]:
    """PEFT's LoRA layers by their name in the transformers model."""
    return {
        name: module
        for name, module in wrapped.base_model.model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }


def edit_config(directory: Path, **fields: Any) -> None:
    config_file = directory / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **fields}))


def edit_tensors(
    directory: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Rewrites adapter_model.safetensors with ``edit(tensors)``'s result."""
    tensors = load_file(directory / SAFETENSORS)
    save_file(edit(tensors), directory / SAFETENSORS, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("model", "safe", "lora", "rank"),
    [
        pytest.param("llama", True, {}, 8, id="llama-q-v"),
        pytest.param(
            "llama",
            False,
            {"r": 4, "lora_alpha": 32, "target_modules": ALL_TARGETS},
            4,
            id="llama-all-seven-bin",
        ),
        pytest.param(
            "qwen3",
            True,
            {"r": 16, "lora_alpha": 8, "target_modules": ALL_TARGETS, "use_rslora": True},
            16,
            id="qwen3-all-seven-rslora",
        ),
        pytest.param(
            "qwen3",
            True,
            {"target_modules": "all-linear", "use_rslora": True, "rank_pattern": {"k_proj": 2}},
            8,
            id="qwen3-all-linear-rslora-rank-pattern",
        ),
        pytest.param(
            "llama",
            True,
            {
                "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
                "rank_pattern": {"q_proj": 4, "model.layers.1.mlp.down_proj": 12},
                "alpha_pattern": {"v_proj": 3, r"layers\.0\.self_attn\.o_proj": 40},
            },
            12,
            id="llama-rank-and-alpha-patterns",
        ),
        pytest.param(
            "llama",
            True,
            {"target_modules": r".*\.layers\.1\.mlp\.(gate|up)_proj"},
            8,
            id="llama-regex-targets-one-layer",
        ),
    ],
)
def test_loaded_weights_reproduce_peft_lora_layers(
    tmp_path: Path, model: str, safe: bool, lora: dict[str, Any], rank: int
) -> None:
    wrapped = save_adapter(tmp_path, model, safe=safe, **lora)
    peft_layers = lora_modules(wrapped)

    adapter = load_lora_adapter(tmp_path, max_lora_rank=64, hf_config=CONFIGS[model])

    assert adapter.path == str(tmp_path)
    assert adapter.rank == rank
    assert sorted(adapter.modules) == sorted(peft_layers)
    torch.manual_seed(1)
    for name, weights in adapter.modules.items():
        layer = peft_layers[name]
        assert weights.lora_a.dtype == weights.lora_b.dtype == torch.float32
        x = torch.randn(3, weights.lora_a.shape[1])
        with torch.no_grad():
            expected = layer(x)
            ours = layer.base_layer(x) + x @ weights.lora_a.T @ weights.lora_b.T
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert adapter.num_bytes == sum(
        4 * (weights.lora_a.numel() + weights.lora_b.numel())
        for weights in adapter.modules.values()
    )


def test_check_returns_the_largest_rank_without_reading_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_adapter(tmp_path, target_modules=ALL_TARGETS, rank_pattern={"o_proj": 24})

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("check_lora_adapter read the weights")

    monkeypatch.setattr(lora_adapter_module, "load_file", no_weights)
    monkeypatch.setattr(torch, "load", no_weights)

    assert check_lora_adapter(tmp_path, max_lora_rank=32, hf_config=CONFIGS["llama"]) == 24


def test_check_reads_a_bin_adapter(tmp_path: Path) -> None:
    save_adapter(tmp_path, safe=False, r=6)

    assert check_lora_adapter(str(tmp_path), max_lora_rank=8, hf_config=CONFIGS["llama"]) == 6


def test_a_bfloat16_adapter_loads_as_float32_with_the_scaling_in_b(tmp_path: Path) -> None:
    wrapped = save_adapter(tmp_path, r=4, lora_alpha=6)
    wrapped.to(torch.bfloat16).save_pretrained(tmp_path)
    layer = lora_modules(wrapped)["model.layers.0.self_attn.q_proj"]

    weights = load_lora_adapter(tmp_path, 8, CONFIGS["llama"]).modules[
        "model.layers.0.self_attn.q_proj"
    ]

    assert weights.lora_a.dtype == weights.lora_b.dtype == torch.float32
    assert torch.equal(weights.lora_a, layer.lora_A["default"].weight.float())
    assert torch.equal(weights.lora_b, layer.lora_B["default"].weight.float() * 1.5)


@pytest.fixture(params=[check_lora_adapter, load_lora_adapter], ids=["check", "load"])
def read(request: pytest.FixtureRequest) -> Any:
    """Both entry points refuse alike."""
    return request.param


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        pytest.param({"use_dora": True}, ["use_dora", "DoRA"], id="dora"),
        pytest.param({"modules_to_save": ["lm_head"]}, ["modules_to_save"], id="modules-to-save"),
        pytest.param({"bias": "lora_only"}, ["bias='lora_only'", "bias='none'"], id="bias"),
        pytest.param({"lora_bias": True}, ["lora_bias"], id="lora-bias"),
        pytest.param(
            {"target_modules": ["q_proj", "embed_tokens"]},
            ["target_modules", "model.embed_tokens", "q_proj, k_proj, v_proj"],
            id="embed-tokens",
        ),
        pytest.param(
            {"target_modules": r".*(q_proj|lm_head)"}, ["target_modules", "lm_head"], id="lm-head"
        ),
        pytest.param({"init_lora_weights": "pissa"}, ["init_lora_weights", "pissa"], id="pissa"),
    ],
)
def test_unsupported_adapter_kinds_are_refused(
    tmp_path: Path, read: Any, lora: dict[str, Any], words: list[str]
) -> None:
    save_adapter(tmp_path, **lora)

    with pytest.raises(LoRAAdapterError) as refusal:
        read(tmp_path, 64, CONFIGS["llama"])

    assert str(refusal.value).startswith(f"LoRA adapter {tmp_path}: ")
    for word in words:
        assert word in str(refusal.value)


def test_another_peft_method_is_refused(tmp_path: Path, read: Any) -> None:
    base = LlamaForCausalLM(CONFIGS["llama"])
    ia3 = peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    peft.get_peft_model(base, ia3).save_pretrained(tmp_path)

    with pytest.raises(LoRAAdapterError, match="peft_type='IA3'; only 'LORA'"):
        read(tmp_path, 64, CONFIGS["llama"])


def test_fan_in_fan_out_is_refused(tmp_path: Path, read: Any) -> None:
    # PEFT resets fan_in_fan_out on nn.Linear layers, so only an edited config has it.
    save_adapter(tmp_path)
    edit_config(tmp_path, fan_in_fan_out=True)

    with pytest.raises(LoRAAdapterError, match="fan_in_fan_out=True"):
        read(tmp_path, 64, CONFIGS["llama"])


def test_embedding_tensors_are_refused_whatever_the_config_says(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path, target_modules=["q_proj", "embed_tokens"])
    edit_config(tmp_path, target_modules=["q_proj"])

    with pytest.raises(
        LoRAAdapterError, match=r"embed_tokens\.lora_embedding_A adapts an embedding"
    ):
        read(tmp_path, 64, CONFIGS["llama"])


def test_a_rank_above_max_lora_rank_is_refused(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path, r=16)

    with pytest.raises(LoRAAdapterError) as refusal:
        read(tmp_path, 8, CONFIGS["llama"])

    message = str(refusal.value)
    assert "rank 16" in message
    assert "max_lora_rank=8" in message
    assert "raise max_lora_rank to at least 16" in message


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ("missing", "no such file or directory"),
        ("file", "is not a directory"),
        ("no-config", "has no adapter_config.json"),
        ("no-weights", "has no weights file"),
    ],
)
def test_missing_files_are_named(tmp_path: Path, read: Any, layout: str, words: str) -> None:
    path = tmp_path / "adapter"
    if layout == "file":
        path.write_text("{}")
    elif layout != "missing":
        save_adapter(path)
        (path / ("adapter_config.json" if layout == "no-config" else SAFETENSORS)).unlink()

    with pytest.raises(LoRAAdapterError) as refusal:
        read(path, 64, CONFIGS["llama"])

    assert f"LoRA adapter {path}: {words}" in str(refusal.value)
    assert "adapter_model.safetensors or adapter_model.bin" in str(refusal.value)


def test_an_adapter_for_another_model_is_refused_by_shape(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path, model="llama")

    with pytest.raises(LoRAAdapterError) as refusal:
        read(tmp_path, 64, CONFIGS["qwen3"])

    message = str(refusal.value)
    assert (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight has shape [64, 8]"
        in message
    )
    assert "expected [128, 8]" in message


def test_a_layer_beyond_the_model_is_refused(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path)
    one_layer = LlamaConfig(**{**TINY, "num_hidden_layers": 1})

    with pytest.raises(
        LoRAAdapterError, match="adapts layer 1, but the model has num_hidden_layers=1"
    ):
        read(tmp_path, 64, one_layer)


def test_a_module_outside_the_targets_is_refused(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path)
    edit_tensors(
        tmp_path, lambda tensors: {k.replace("v_proj", "qkv_proj"): v for k, v in tensors.items()}
    )

    with pytest.raises(LoRAAdapterError) as refusal:
        read(tmp_path, 64, CONFIGS["llama"])

    assert "module 'model.layers.0.self_attn.qkv_proj'" in str(refusal.value)
    assert "supported targets: " + ", ".join(LORA_TARGET_MODULES) in str(refusal.value)


def test_an_a_without_its_b_is_refused(tmp_path: Path, read: Any) -> None:
    save_adapter(tmp_path)
    edit_tensors(
        tmp_path,
        lambda tensors: {k: v for k, v in tensors.items() if "1.self_attn.q_proj.lora_B" not in k},
    )

    with pytest.raises(
        LoRAAdapterError, match=r"has no partner .*layers\.1\.self_attn\.q_proj\.lora_B"
    ):
        read(tmp_path, 64, CONFIGS["llama"])


def test_a_config_rank_that_disagrees_with_the_weights_is_refused(
    tmp_path: Path, read: Any
) -> None:
    # The scaling follows the config's r, so weights of another rank would be scaled wrongly.
    save_adapter(tmp_path)
    edit_config(tmp_path, r=4)

    with pytest.raises(LoRAAdapterError, match=r"shape \[8, 64\]; expected \[4, 64\].*r=4"):
        read(tmp_path, 64, CONFIGS["llama"])


def test_a_dora_magnitude_tensor_is_refused_even_if_the_config_hides_it(
    tmp_path: Path, read: Any
) -> None:
    save_adapter(tmp_path, use_dora=True)
    edit_config(tmp_path, use_dora=False)

    with pytest.raises(LoRAAdapterError, match=r"unexpected tensor .*lora_magnitude_vector"):
        read(tmp_path, 64, CONFIGS["llama"])


def test_a_bin_with_pickled_objects_is_not_unpickled(tmp_path: Path) -> None:
    save_adapter(tmp_path, safe=False)
    state = torch.load(tmp_path / "adapter_model.bin", weights_only=True)
    torch.save({**state, "created": datetime.date(2025, 1, 1)}, tmp_path / "adapter_model.bin")

    with pytest.raises(LoRAAdapterError, match="weights-only torch file"):
        load_lora_adapter(tmp_path, 64, CONFIGS["llama"])
