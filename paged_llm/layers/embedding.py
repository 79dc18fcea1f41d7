"""Token embedding and LM head, split over the tensor-parallel ranks by vocabulary rows.

Each rank holds ``ceil(vocab / ranks)`` rows; the last rank's rows past the vocabulary are
zero. A tied LM head shares the embedding's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.layers.linear import Linear
from paged_llm.layers.weights import CheckpointTensor


def _vocab_shard(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    """``(first row, rows held, rows of real tokens)`` of this rank."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    return start, per_rank, max(min(per_rank, vocab_size - start), 0)


def _load_vocab_rows(
    param: nn.Parameter, loaded: CheckpointTensor, vocab_size: int, tp: TensorParallelGroup
) -> None:
    loaded.check_shape((vocab_size, param.shape[1]))
    start, _, real_rows = _vocab_shard(vocab_size, tp)
    param.data[:real_rows].copy_(loaded.read(rows=(start, real_rows)))
    param.data[real_rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup; with several ranks, each looks up the ids it holds, one
    all-reduce combines them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.vocab_start, rows, _ = _vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard: int | None) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size, self.tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(~held, 0), self.weight)
        hidden.masked_fill_(~held.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(Linear):
    """Logits over the whole vocabulary, on rank 0: each rank scores its rows, and rank 0
    gathers them (other ranks get None)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        _, rows, _ = _vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard: int | None) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size, self.tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self._matmul(hidden, None)
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather_to_first(logits)
        return None if gathered is None else gathered[:, : self.vocab_size]
