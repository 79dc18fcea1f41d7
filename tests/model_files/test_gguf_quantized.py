"""quantization="gguf": a .gguf file's quantized projections kept packed and dequantized in
each matmul. The reference is gguf-py's own dequantizer, and transformers running the
weights it dequantizes (what quantization=None loads)."""

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from paged_llm import LLM, SamplingParams  # noqa: E402
from paged_llm.layers.linear import PackedLinear, RowShard, process_weights_after_loading  # noqa: E402
from paged_llm.layers.quantization import get_quantized_linear_method  # noqa: E402
from paged_llm.layers.quantization.grouped import (  # noqa: E402
    GroupQuantizedLinearMethod,
    GroupQuantizedTensor,
)
from paged_llm.model_files import resolve_model  # noqa: E402
from paged_llm.model_files.gguf_quantized import KEPT_QUANTIZED_TYPES, repack  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402
from tests.fake_gpu import FakeGpuPlatform  # noqa: E402
from tests.layers.quantization.activation_rounding import (  # noqa: E402
    PROJECTIONS,
    round_inputs,
    round_inputs_of,
)
from tests.model_files.test_gguf import load_converted, tiny_model, write_gguf  # noqa: E402

# gguf-py quantizes these itself; for the K-quants it only dequantizes.
_GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q8_0")


def gguf_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A ``[rows, cols]`` tensor in ``type_name``'s blocks: gguf-py's quantization of
    random weights, or for the K-quants random blocks with sane float16 scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in _GGUF_QUANTIZES:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_elements, block_bytes), dtype=np.uint8)
    # Every other byte is codes and sub-scales, any value valid; only the float16 super-block
    # scales (d, and dmin where there is one) must be finite.
    scale_bytes = {"Q6_K": [208]}.get(type_name, [0, 2])
    for start in scale_bytes:
        scales = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., start : start + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_dequantized(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("type_name", KEPT_QUANTIZED_TYPES)
def test_repacked_weights_dequantize_to_ggufs_own_values(type_name: str) -> None:
    blocks = gguf_blocks(type_name, 6, 512)
    weight = repack(blocks, type_name, (6, 512))
    expected = gguf_dequantized(blocks, type_name)
    assert torch.equal(weight.dequantize(torch.float32), expected)
    # A tensor-parallel rank's rows and columns are the same values.
    assert torch.equal(weight.rows(2, 3).dequantize(torch.float32), expected[2:5])
    assert torch.equal(weight.cols(256, 128).dequantize(torch.float32), expected[:, 256:384])
    with pytest.raises(ValueError, match="quantization groups"):
        weight.cols(8, 64)


def test_a_layer_multiplies_projections_of_different_types() -> None:
    """A GGUF file may give q, k and v different types (Q4_K_M mixes Q4_K and Q6_K)."""
    types = ["Q4_K", "Q6_K"]
    blocks = [gguf_blocks(name, 8, 256, seed) for seed, name in enumerate(types)]
    method = get_quantized_linear_method("gguf", triton=False)
    assert isinstance(method, GroupQuantizedLinearMethod)
    layer = PackedLinear(256, [RowShard(0, 8, 8), RowShard(0, 8, 8)], False, method)
    for shard, (name, raw) in enumerate(zip(types, blocks, strict=True)):
        tensor = GroupQuantizedTensor(f"p{shard}", repack(raw, name, (8, 256)))
        method.load_quantized(layer, tensor, shard)
    process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    dequantized = [gguf_dequantized(raw, name) for name, raw in zip(types, blocks, strict=True)]
    expected = F.linear(round_inputs(x, GGUF_GROUP), torch.cat(dequantized))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, type_name: str) -> Path:
        if (arch, type_name) not in made:
            # 128 intermediate features split into two ranks' groups of 32.
            model = tiny_model(arch, intermediate_size=128)
            path = tmp_path_factory.mktemp("gguf") / f"{arch}-{type_name}.gguf"
            made[(arch, type_name)] = write_gguf(path, model, arch, matrix_type=type_name)
        return made[(arch, type_name)]

    return make


# The reference's modules that the file stores quantized: their inputs are rounded as the
# CPU kernels round them.
QUANTIZED_MATMULS = (*PROJECTIONS, "lm_head")
# Every GGUF type these tests write has groups (16 or 32 features), none one a row.
GGUF_GROUP = 32
PROMPTS = [[5 + 7 * i + j for j in range(6 + 5 * i)] for i in range(4)]


@pytest.mark.parametrize(("arch", "type_name"), [("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_greedy_and_logprobs_match_transformers_on_ggufs_dequantized_weights(
    arch: str, type_name: str, quantized_gguf: Callable[[str, str], Path], cache: Path
) -> None:
    path = quantized_gguf(arch, type_name)
    reference = round_inputs_of(
        load_converted(resolve_model(path).path), QUANTIZED_MATMULS, GGUF_GROUP
    )
    expected = [hf_greedy(reference, prompt, 12) for prompt in PROMPTS]
    with torch.no_grad():
        reference_logprobs = torch.log_softmax(reference(torch.tensor([PROMPTS[3]])).logits[0], -1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    with LLM(path, quantization="gguf", max_model_len=64) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    prompt_logprobs = outputs[3].prompt_logprobs
    assert prompt_logprobs is not None
    for position, token in enumerate(PROMPTS[3][1:], start=1):
        actual = prompt_logprobs[position][token].logprob
        # float32's tolerances: a Python float would be held to float64's.
        torch.testing.assert_close(
            actual, reference_logprobs[position - 1, token].item(), rtol=1.3e-6, atol=1e-5
        )


def test_a_gguf_file_loads_kept_quantized_unless_dequantize_is_asked_for(
    quantized_gguf: Callable[[str, str], Path], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """None, the default, loads a .gguf file as quantization="gguf" does and says so;
    "dequantize" loads the float conversion, token for token transformers' on it."""
    path = quantized_gguf("llama", "Q4_1")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    with caplog.at_level(logging.INFO, logger="paged_llm"), LLM(path, max_model_len=64) as llm:
        assert llm.llm_engine.config.quantization == "gguf"
        by_default = greedy(llm)
    assert f"Kept Q4_1 packed from {path.name}: " in caplog.text
    with LLM(path, quantization="gguf", max_model_len=64) as llm:
        assert greedy(llm) == by_default
    reference = load_converted(resolve_model(path, quantization="dequantize").path)
    with LLM(path, quantization="dequantize", max_model_len=64) as llm:
        assert llm.llm_engine.config.quantization is None
        assert greedy(llm) == [hf_greedy(reference, prompt, 12) for prompt in PROMPTS]


def test_dequantize_on_a_float_checkpoint_is_its_float_load(
    llama_dir: Path,
) -> None:
    with LLM(llama_dir, quantization="dequantize", max_model_len=64) as llm:
        assert llm.llm_engine.config.quantization is None


def test_the_gpu_path_multiplies_through_the_triton_kernel_with_the_same_tokens(
    quantized_gguf: Callable[[str, str], Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the fake GPU platform every quantized projection and the LM head (Q4_1 nibbles,
    and the Q8_0 int8 codes of the other case) go through csrc_triton's
    group_quantized_matmul, under the interpreter, and greedy tokens equal transformers on
    the dequantized weights."""
    import csrc_triton

    calls: list[torch.dtype] = []
    kernel = csrc_triton.group_quantized_matmul

    def counted(x: torch.Tensor, codes: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(codes.dtype)
        return kernel(x, codes, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(csrc_triton, "group_quantized_matmul", counted)
    for arch, type_name in (("llama", "Q4_1"), ("qwen2", "Q8_0")):
        path = quantized_gguf(arch, type_name)
        reference = load_converted(resolve_model(path).path)
        expected = [hf_greedy(reference, prompt, 6) for prompt in PROMPTS[:2]]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        with LLM(
            path,
            quantization="gguf",
            device=FakeGpuPlatform(),
            dtype="float32",
            max_model_len=64,
            # Small steps: the start-up's profile step and every forward run interpreted.
            max_num_seqs=4,
            max_num_batched_tokens=32,
        ) as llm:
            prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert set(calls) == {torch.uint8, torch.int8}


@pytest.mark.slow  # two rank processes: 11 s
def test_two_ranks_split_the_quantized_weights(
    quantized_gguf: Callable[[str, str], Path], cache: Path
) -> None:
    path = quantized_gguf("llama", "Q4_1")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, quantization="gguf", max_model_len=64) as llm:
        one_rank = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, quantization="gguf", max_model_len=64, tensor_parallel_size=2) as llm:
        two_ranks = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert two_ranks == one_rank


def test_gguf_quantization_needs_a_gguf_model(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='gguf'.*Pass the \.gguf file"):
        LLM(llama_dir, quantization="gguf")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
