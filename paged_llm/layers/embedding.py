"""Token embedding and LM head, split over the tensor-parallel ranks by vocabulary rows.

Each rank holds ``ceil(vocab / ranks)`` rows; the last rank's rows past the vocabulary are
zero. Both are a `Linear` over those rows, so they keep their weight in any format a
`QuantizedLinearMethod` that `quantizes_embeddings` offers; the embedding looks rows up,
the LM head multiplies by them. A tied LM head shares the embedding's tensors, quantized
or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.linear import Linear
from paged_llm.layers.quantization import QuantizedLinearMethod
from paged_llm.layers.weights import CheckpointPart, CheckpointTensor


def _vocab_shard(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """``(first row, rows held)`` of this rank."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


class VocabParallelEmbedding(Linear):
    """Embedding lookup; with several ranks, each looks up the ids it holds, one
    all-reduce combines them.

    ``dtype`` is what a quantized table's rows are dequantized to (the model's dtype); a
    float table's rows come in its own.
    """

    # The lookup reads the dense weight: nothing here to pack for oneDNN.
    multiplies = False

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        quant_method: QuantizedLinearMethod | None = None,
    ) -> None:
        self.vocab_start, rows = _vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False, quant_method=quant_method)
        self.vocab_size = vocab_size
        self.tp = tp
        self.dtype = dtype

    def checkpoint_part(self, loaded: CheckpointTensor, shard: int | None) -> CheckpointPart:
        # The last rank's rows past the vocabulary read as zero.
        loaded.check_shape((self.vocab_size, self.in_features))
        return CheckpointPart((self.vocab_start, self.out_features), None, slice(None))

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight and its format's tensors (scales, quantized pieces)."""
        self.quant_method = embedding.quant_method
        self.weight = embedding.weight
        for name, buffer in embedding.named_buffers(recurse=False):
            if buffer is not None:
                self.register_buffer(name, buffer, persistent=False)
        self.quantized_pieces = embedding.quantized_pieces

    def _rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.embedding(token_ids, self.weight)
        return self.quant_method.embedding(self, token_ids, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.out_features)
        hidden = self._rows(local.masked_fill(~held, 0))
        hidden.masked_fill_(~held.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary, on rank 0: each rank scores its rows, and rank 0
    gathers them (other ranks get None)."""

    multiplies = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self._matmul(hidden, None)
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather_to_first(logits)
        return None if gathered is None else gathered[:, : self.vocab_size]
