"""Rank 0's pooler: the hidden states of a step's pooling sequences -> their outputs.

Only the rows that pool are read from the step's ``[T, hidden]`` states: the last token
of a prompt whose last chunk ran (LAST), the first token (CLS), or a chunk's rows summed
(MEAN) or kept (ALL). A prompt chunked over several steps accumulates on its sequence
(``Sequence.pooling_state``) until its last chunk; a chunk that starts at position 0 starts
it anew, so a preempted sequence's recompute does not count twice. Then, for the
sequences that finished, the classifier head where the task takes it, and the task's
normalization or activation, in float32 on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from paged_llm.config import PoolerSpec
from paged_llm.engine.scheduler import ScheduledBatch
from paged_llm.engine.sequence import Sequence
from paged_llm.models.classifier import LlamaForSequenceClassification
from paged_llm.models.llama import LlamaForCausalLM
from paged_llm.pooling_params import PoolingParams

# Tasks whose output goes through the classifier head (on a model that has one).
_HEAD_TASKS = ("classify", "score", "token_classify", "encode", "reward")


class Pooler:
    """Pools the hidden states of ``model`` as ``spec`` says."""

    def __init__(self, model: LlamaForCausalLM, spec: PoolerSpec) -> None:
        self.model = model
        self.spec = spec

    def pool(
        self, hidden: torch.Tensor, batch: ScheduledBatch, query_start_loc: np.ndarray
    ) -> dict[int, torch.Tensor]:
        """Account this step's rows of each pooling sequence; return the outputs of those
        whose prompt is now computed, by ``seq_id``."""
        # (sequence, its row in ``hidden``) for the single rows read this step.
        single_rows: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        pooling = set(map(id, batch.pooling_seqs))
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens, strict=True)):
            if id(seq) not in pooling:
                continue
            params = seq.request.pooling_params
            assert params is not None
            start = int(query_start_loc[i])
            first_chunk = seq.num_computed_tokens == 0
            last_chunk = seq.num_computed_tokens + count == seq.num_tokens
            pooling_type = params.pooling_type
            if pooling_type == "LAST":
                if last_chunk:
                    single_rows.append((seq, start + count - 1))
            elif pooling_type == "CLS":
                if first_chunk:
                    single_rows.append((seq, start))
            elif pooling_type == "MEAN":
                chunk_sum = hidden[start : start + count].sum(dim=0, dtype=torch.float32)
                state = seq.pooling_state
                seq.pooling_state = (
                    chunk_sum
                    if first_chunk or not isinstance(state, torch.Tensor)
                    else state + chunk_sum
                )
            else:  # ALL
                # NOTE: a copy: the step's hidden states may live in a reused buffer.
                rows = hidden[start : start + count].to(torch.float32, copy=True)
                parts = seq.pooling_state
                seq.pooling_state = (
                    [rows]
                    if first_chunk or not isinstance(parts, list)
                    else [
                        *parts,
                        rows,
                    ]
                )
            if last_chunk:
                finished.append(seq)
        if single_rows:
            index = torch.tensor([row for _, row in single_rows], device=hidden.device)
            for (seq, _), row in zip(
                single_rows, hidden.index_select(0, index).float(), strict=True
            ):
                seq.pooling_state = row
        outputs: dict[int, torch.Tensor] = {}
        for seq in finished:
            params = seq.request.pooling_params
            assert params is not None
            state = seq.pooling_state
            seq.pooling_state = None
            if params.pooling_type == "MEAN":
                assert isinstance(state, torch.Tensor)
                pooled = state / seq.num_tokens
            elif params.pooling_type == "ALL":
                assert isinstance(state, list)
                pooled = torch.cat(state)
            else:
                assert isinstance(state, torch.Tensor)
                pooled = state
            outputs[seq.seq_id] = self._finish(pooled, params).cpu()
        return outputs

    def _finish(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """The head, then the task's post-processing, of one pooled vector (or one per
        token)."""
        if self.spec.num_labels is not None and params.task in _HEAD_TASKS:
            assert isinstance(self.model, LlamaForSequenceClassification)
            output = self.model.classify(pooled).float()
            if params.use_activation:
                activation = self.spec.activation
                if activation == "softmax":
                    output = output.softmax(dim=-1)
                elif activation == "sigmoid":
                    output = output.sigmoid()
            return output
        if params.dimensions is not None:
            pooled = pooled[..., : params.dimensions]
        if params.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled
