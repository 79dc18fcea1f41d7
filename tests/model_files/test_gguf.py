"""GGUF conversion and its cache, on tiny random models written as GGUF files here.

Each test model is a random transformers model written the way llama.cpp's convert_hf_to_gguf.py
writes it: tensor names from gguf-py's own name tables (independent of ours), q/k rows permuted
for llama. Converting it back must give the same logits as the original model.
"""

import json
import logging
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

gguf = pytest.importorskip("gguf")

from paged_llm.model_files import convert_gguf, resolve_model  # noqa: E402
from paged_llm.model_files import gguf as gguf_files  # noqa: E402

# A byte-level BPE vocabulary: the 256 byte symbols, two merges and three special tokens.
_BYTE_SYMBOLS = list(transformers.convert_slow_tokenizer.bytes_to_unicode().values())
_TOKENS = [*_BYTE_SYMBOLS, "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ARCHES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def tiny_model(
    arch: str, *, tied: bool = True, **overrides: object
) -> transformers.PreTrainedModel:
    """A random 2-layer model with grouped-query attention and non-trivial norm weights."""
    settings = {
        "vocab_size": len(_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
    }
    config = transformers.AutoConfig.for_model(arch, **{**settings, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
    return model.eval()


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_rope_factors(head_dim: int, rope_theta: float, scaling: dict) -> np.ndarray:
    """The llama3 branch of `LlamaModel.generate_extra_tensors` in convert_hf_to_gguf.py."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    arch: str,
    *,
    matrix_type: str = "F32",
    rope_freqs: np.ndarray | None = None,
    rope_scaling: tuple[str, float] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model` as llama.cpp would; 2-D weights in `matrix_type`, 1-D tensors in F32."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([1] * (len(_TOKENS) - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(_TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(_TOKENS.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    name_map = gguf.get_tensor_name_map(_ARCHES[arch], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads, config.num_key_value_heads)
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        _add_tensor(writer, gguf_name, array, matrix_type if array.ndim == 2 else "F32")
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: object, name: str, array: np.ndarray, type_name: str) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def round_trip(array: torch.Tensor, type_name: str) -> torch.Tensor:
    """What a tensor becomes after quantizing to `type_name` and dequantizing."""
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(array.numpy(), qtype), qtype)
    )


def load_converted(path: Path) -> transformers.PreTrainedModel:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def assert_same_logits(original: transformers.PreTrainedModel, converted_dir: Path) -> None:
    converted = load_converted(converted_dir)
    input_ids = torch.randint(0, len(_TOKENS), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(input_ids).logits
        actual = converted(input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def read_tensor(directory: Path, name: str) -> torch.Tensor:
    with safe_open(directory / "model.safetensors", "pt") as weights:
        return weights.get_tensor(name)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records the source of every conversion that actually runs."""
    calls: list[Path] = []
    convert = gguf_files.convert_gguf

    def counting_convert(gguf_path: Path, out_dir: Path, **kwargs: Any) -> dict[str, str]:
        calls.append(Path(gguf_path))
        return convert(gguf_path, out_dir, **kwargs)

    monkeypatch.setattr(gguf_files, "convert_gguf", counting_convert)
    return calls


@pytest.mark.parametrize(
    ("arch", "tied", "overrides"),
    [
        ("llama", True, {}),
        ("llama", False, {}),
        ("qwen2", True, {}),
        # head_dim wider than hidden_size / num_heads, as in Qwen3-0.6B.
        ("qwen3", False, {"head_dim": 32}),
    ],
)
def test_converted_model_gives_original_logits(
    tmp_path: Path, cache: Path, arch: str, tied: bool, overrides: dict
) -> None:
    original = tiny_model(arch, tied=tied, **overrides)
    gguf_path = write_gguf(tmp_path / f"{arch}.gguf", original, arch)

    resolved = resolve_model(gguf_path)

    assert resolved.source == "gguf" and resolved.from_gguf
    assert resolved.path.parent == cache / "gguf"
    config = transformers.AutoConfig.from_pretrained(resolved.path)
    # config.json holds every field of the model's config class, so paged_llm reads it
    # through the base class (`model_info._hf_config`) into the same values; all but
    # transformers' own generation switch `use_cache`, which the base class drops and
    # paged_llm never reads, and the path it was read from.
    read = transformers.PretrainedConfig.from_json_file(resolved.path / "config.json")
    fields = [name for name in config.to_dict() if name not in ("use_cache", "_name_or_path")]
    assert {name: getattr(read, name, None) for name in fields} == {
        name: getattr(config, name) for name in fields
    }
    assert config.architectures == [type(original).__name__]
    assert config.tie_word_embeddings is tied
    assert config.rms_norm_eps == 1e-5
    with safe_open(resolved.path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert ("lm_head.weight" in names) is not tied
    assert_same_logits(original, resolved.path)


@pytest.mark.parametrize("type_name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_matrices_are_dequantized_exactly(tmp_path: Path, type_name: str) -> None:
    original = tiny_model("llama")
    gguf_path = write_gguf(tmp_path / "model.gguf", original, "llama", matrix_type=type_name)

    convert_gguf(gguf_path, tmp_path / "out")

    state = original.state_dict()
    # q rows are permuted in the file; quantization blocks run along rows, so they commute.
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]:
        converted = read_tensor(tmp_path / "out", name)
        expected_dtype = {"F16": torch.float16, "BF16": torch.bfloat16}.get(
            type_name, torch.float32
        )
        assert converted.dtype == expected_dtype
        torch.testing.assert_close(
            converted.float(), round_trip(state[name], type_name), rtol=0, atol=0
        )
    norm = read_tensor(tmp_path / "out", "model.layers.0.input_layernorm.weight")
    torch.testing.assert_close(norm, state["model.layers.0.input_layernorm.weight"], rtol=0, atol=0)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # head_dim 16 with theta 5e5 puts frequencies in all three bands (kept, smoothed, scaled).
    original = tiny_model(
        "llama", max_position_embeddings=131072, rope_parameters={**scaling, "rope_theta": 500000.0}
    )
    rope_freqs = llama_cpp_rope_factors(16, 500000.0, scaling)
    assert {1.0, 32.0} < set(rope_freqs.tolist())
    gguf_path = write_gguf(tmp_path / "llama3.gguf", original, "llama", rope_freqs=rope_freqs)

    convert_gguf(gguf_path, tmp_path / "out")

    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.rope_parameters == {**scaling, "rope_theta": 500000.0}
    assert_same_logits(original, tmp_path / "out")


def test_unknown_rope_freqs_are_rejected(tmp_path: Path) -> None:
    original = tiny_model("llama", rope_theta=500000.0)
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope_freqs = llama_cpp_rope_factors(16, 500000.0, scaling)
    gguf_path = write_gguf(tmp_path / "odd.gguf", original, "llama", rope_freqs=rope_freqs)

    with pytest.raises(ValueError, match="rope_freqs"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_linear_rope_scaling_is_carried_over(tmp_path: Path) -> None:
    scaling = {"rope_type": "linear", "factor": 4.0}
    original = tiny_model("llama", rope_parameters={**scaling, "rope_theta": 10000.0})
    gguf_path = write_gguf(
        tmp_path / "linear.gguf", original, "llama", rope_scaling=("linear", 4.0)
    )

    convert_gguf(gguf_path, tmp_path / "out")

    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.rope_parameters == {**scaling, "rope_theta": 10000.0}
    assert_same_logits(original, tmp_path / "out")


def test_unsupported_rope_scaling_is_rejected(tmp_path: Path) -> None:
    gguf_path = write_gguf(
        tmp_path / "yarn.gguf", tiny_model("llama"), "llama", rope_scaling=("yarn", 4.0)
    )

    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_large_models_are_sharded_with_an_index(tmp_path: Path) -> None:
    original = tiny_model("llama")
    gguf_path = write_gguf(tmp_path / "model.gguf", original, "llama")

    convert_gguf(gguf_path, tmp_path / "out", max_shard_bytes=40_000)

    shards = sorted(path.name for path in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert_same_logits(original, tmp_path / "out")


def test_generation_config_and_tokenizer_come_from_metadata(tmp_path: Path) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")

    convert_gguf(gguf_path, tmp_path / "out")

    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.bos_token_id == _TOKENS.index("<|im_start|>")
    assert generation.eos_token_id == _TOKENS.index("<|im_end|>")
    assert generation.pad_token_id == _TOKENS.index("<|endoftext|>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_max_length == 256
    messages = [{"role": "user", "content": "the"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out")


def test_tensors_the_model_class_does_not_have_are_rejected(tmp_path: Path) -> None:
    bias = {"blk.0.attn_output.bias": np.zeros(64, dtype=np.float32)}
    gguf_path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", extra_tensors=bias)

    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.o_proj.bias'\]"):
        convert_gguf(gguf_path, tmp_path / "out")


def test_out_dir_must_be_empty(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")

    with pytest.raises(ValueError, match="must be empty"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_missing_gguf_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)

    with pytest.raises(ImportError, match="pip install gguf"):
        gguf_files.import_gguf()


def test_second_resolve_reuses_the_conversion(
    tmp_path: Path, cache: Path, conversions: list[Path]
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")

    first = resolve_model(gguf_path)
    second = resolve_model(str(gguf_path))

    assert first == second
    assert conversions == [gguf_path.resolve()]


def test_a_first_conversion_says_where_it_caches_and_about_how_long(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama").resolve()

    with caplog.at_level(logging.INFO, logger="paged_llm"):
        resolved = resolve_model(gguf_path)
        first = [record.getMessage() for record in caplog.records]
        caplog.clear()
        resolve_model(gguf_path)

    assert resolved.path.parent == cache / "gguf"
    assert (
        f"Converting {gguf_path} into {resolved.path} (once; later loads reuse it): "
        "dequantizing its weights to float, ~1 s" in first
    )
    assert any(message.startswith(f"Converted {gguf_path.name} in ") for message in first)
    assert not [record for record in caplog.records if "Convert" in record.getMessage()]


def test_changed_file_is_converted_again(
    tmp_path: Path, cache: Path, conversions: list[Path]
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")
    first = resolve_model(gguf_path)

    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_model(gguf_path)

    assert second.path != first.path
    assert len(conversions) == 2
    assert sorted(path.name for path in (cache / "gguf").iterdir()) == sorted(
        [first.path.name, second.path.name]
    )


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_temp_dir_of_a_crashed_conversion_is_not_trusted(
    tmp_path: Path, cache: Path, conversions: list[Path]
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")
    key = gguf_files.gguf_cache_key(gguf_path)
    host = socket.gethostname()
    crashed = cache / "gguf" / f".tmp-{key}-{host}-{_dead_pid()}-x1"
    running = cache / "gguf" / f".tmp-{key}-{host}-{os.getpid()}-x2"
    for temp_dir in (crashed, running):
        temp_dir.mkdir(parents=True)
        (temp_dir / "config.json").write_text("{}")

    resolved = resolve_model(gguf_path)

    assert conversions == [gguf_path.resolve()]
    assert (resolved.path / gguf_files.MARKER_FILE).is_file()
    assert not crashed.exists()
    assert running.exists(), "a conversion still running in another process must be left alone"


def test_entry_without_marker_is_converted_again(
    tmp_path: Path, cache: Path, conversions: list[Path]
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")
    entry = cache / "gguf" / gguf_files.gguf_cache_key(gguf_path)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")

    resolved = resolve_model(gguf_path)

    assert resolved.path == entry
    assert conversions == [gguf_path.resolve()]
    assert (entry / gguf_files.MARKER_FILE).is_file()
    assert (entry / "model.safetensors").is_file()


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")

    def crash(gguf_path: Path, out_dir: Path, **kwargs: object) -> None:
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_files, "convert_gguf", crash)
        with pytest.raises(RuntimeError, match="mid-conversion"):
            resolve_model(gguf_path)
    assert list((cache / "gguf").iterdir()) == []

    assert (resolve_model(gguf_path).path / "model.safetensors").is_file()


def test_a_conversion_for_kept_weights_leaves_them_in_the_gguf_file(
    tmp_path: Path, cache: Path, conversions: list[Path]
) -> None:
    """What quantization="gguf" (and None, by default) loads: config, tokenizer and the
    float tensors written, each quantized tensor left in the .gguf file and named in the
    marker with its type; its own cache entry beside the float conversion's."""
    model = tiny_model("llama", tied=False)
    gguf_path = write_gguf(tmp_path / "model.gguf", model, "llama", matrix_type="Q8_0")

    kept = resolve_model(gguf_path, quantization=None)
    as_float = resolve_model(gguf_path, quantization="dequantize")

    assert kept.path != as_float.path
    assert resolve_model(gguf_path, quantization="gguf") == kept
    assert len(conversions) == 2
    with safe_open(kept.path / "model.safetensors", "pt") as weights:
        written = set(weights.keys())
    assert written == {name for name in model.state_dict() if name.endswith("norm.weight")}
    marker = json.loads((kept.path / gguf_files.MARKER_FILE).read_text())
    assert marker["read_from_gguf"] == {
        name: "Q8_0" for name in model.state_dict() if not name.endswith("norm.weight")
    }
    with safe_open(as_float.path / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(model.state_dict())
    assert (kept.path / "tokenizer.json").is_file()
    assert (kept.path / "config.json").read_text() == (as_float.path / "config.json").read_text()


def test_float_embeddings_leave_the_embedding_in_the_conversion(
    tmp_path: Path, cache: Path
) -> None:
    model = tiny_model("llama")
    gguf_path = write_gguf(tmp_path / "model.gguf", model, "llama", matrix_type="Q8_0")

    resolved = resolve_model(gguf_path, quantization="gguf", quantize_embeddings=False)

    with safe_open(resolved.path / "model.safetensors", "pt") as weights:
        assert "model.embed_tokens.weight" in set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == torch.float32


def test_float_projections_are_not_kept_and_load_as_float_unless_gguf_is_asked_for(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gguf_path = write_gguf(tmp_path / "model.gguf", tiny_model("llama"), "llama")

    with caplog.at_level(logging.INFO, logger="paged_llm"):
        resolved = resolve_model(gguf_path, quantization=None)

    assert resolved == resolve_model(gguf_path)
    assert "tensor blk.0.attn_q.weight is F32, which is not kept quantized: loading the " in (
        caplog.text
    )
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight is F32.*'dequantize'"):
        resolve_model(gguf_path, quantization="gguf")


def test_the_layout_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    gguf_path = write_gguf(
        tmp_path / "model.gguf", tiny_model("qwen2"), "qwen2", matrix_type="Q4_0"
    )
    reader = gguf.GGUFReader(gguf_path)

    layout = gguf_files.gguf_layout(gguf_path)

    assert [(t.name, t.shape, t.type_name, t.start, t.num_bytes) for t in layout.tensors] == [
        (
            t.name,
            tuple(int(d) for d in reversed(t.shape)),
            t.tensor_type.name,
            t.data_offset,
            t.n_bytes,
        )
        for t in reader.tensors
    ]
    scalars = {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types
        and field.types[0] != gguf.GGUFValueType.ARRAY
        and not name.startswith("GGUF.")
    }
    assert layout.metadata == pytest.approx(scalars)
