"""The vocabulary layers keep each rank's rows, in float or a quantized format: the
lookup returns those rows, the LM head multiplies by them, and the last rank's rows past
the vocabulary are zero."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from paged_llm.layers.quantization import get_quantized_linear_method
from paged_llm.layers.quantization.grouped import GroupQuantizedLinearMethod, GroupQuantizedTensor
from paged_llm.layers.quantization.per_channel import quantize_per_channel
from paged_llm.layers.weights import CheckpointTensor

gguf = pytest.importorskip("gguf")

from paged_llm.model_files.gguf_quantized import repack  # noqa: E402
from tests.layers.quantization.activation_rounding import round_inputs  # noqa: E402

VOCAB, HIDDEN, RANKS = 10, 64, 3  # 4 rows a rank; the last holds 2 tokens and 2 zero rows


def _vocabulary() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(VOCAB, HIDDEN)


def _stored_values(quantization: str | None, weight: torch.Tensor) -> torch.Tensor:
    """The float values each format stands for, from the format's own definition."""
    if quantization is None:
        return weight
    if quantization == "int8":
        codes, scale = quantize_per_channel(weight, torch.int8)
        return codes.float() * scale[:, None]
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))


def _layer(
    layer_class: type[VocabParallelEmbedding], quantization: str | None, rank: int
) -> VocabParallelEmbedding:
    weight = _vocabulary()
    method = get_quantized_linear_method(quantization, triton=False)
    layer = layer_class(VOCAB, HIDDEN, TensorParallelGroup(rank, RANKS), torch.float32, method)
    if isinstance(method, GroupQuantizedLinearMethod):
        raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
        quantized = repack(np.asarray(raw), "Q8_0", (VOCAB, HIDDEN))
        method.load_quantized(layer, GroupQuantizedTensor("embed", quantized), None)
    else:
        layer.load_weight(layer.weight, CheckpointTensor("embed", weight), None)
    if method is not None:
        method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("quantization", [None, "int8", "gguf"])
@pytest.mark.parametrize("rank", range(RANKS))
def test_each_rank_looks_up_and_scores_its_own_rows(quantization: str | None, rank: int) -> None:
    values = _stored_values(quantization, _vocabulary())
    rows = F.pad(values, (0, 0, 0, 4 * RANKS - VOCAB))[4 * rank : 4 * rank + 4]
    embedding = _layer(VocabParallelEmbedding, quantization, rank)
    head = _layer(ParallelLMHead, quantization, rank)
    with torch.no_grad():
        looked_up = embedding._rows(torch.tensor([3, 0, 2, 1]))
        x = torch.randn(5, HIDDEN)
        logits = head._matmul(x, None)
    torch.testing.assert_close(looked_up, rows[[3, 0, 2, 1]], rtol=0, atol=0)
    # On CPU a quantized LM head multiplies activations rounded to int8 per block.
    group_size = {None: None, "int8": None, "gguf": 32}[quantization]
    multiplied = x if quantization is None else round_inputs(x, group_size)
    torch.testing.assert_close(logits, multiplied @ rows.T, rtol=1e-5, atol=1e-5)
