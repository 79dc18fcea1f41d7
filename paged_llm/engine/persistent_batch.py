"""The custom logits processors of an engine (rank 0), and the persistent batch they see.

vLLM keeps its running requests in a persistent batch whose rows change only where
requests come and go, and its logits processors keep per-row state across steps. Here the
runner's step order is the scheduler's, so `PersistentBatch` keeps that row assignment
alongside: the sequences that sample in a step hold rows ``0 .. B-1``; one that no longer
samples leaves its row, a new one takes the lowest free row (or the next one at the end),
and rows still free are filled by moving the last rows down. `LogitsProcessors` tells its
processors each step's changes (`BatchUpdate`) and hands the sampler functions that put the
step's logits rows in persistent order, apply the processors and put the rows back.

None of this exists when no processor is configured: the runner then builds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_llm.config import EngineConfig
from paged_llm.engine.sequence import Sequence
from paged_llm.layers.sampler import LogitsHook, SamplingMetadata
from paged_llm.logits_processors import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)


class PersistentBatch:
    """The rows of the sampling sequences: each keeps its row for as long as it samples
    step after step."""

    def __init__(self) -> None:
        self._rows: list[int] = []  # row -> seq_id
        # seq_id -> its output token ids: the live list `BatchUpdate.added` handed out.
        self._outputs: dict[int, list[int]] = {}

    def update(self, seqs: list[Sequence]) -> tuple[BatchUpdate | None, list[int]]:
        """Give this step's sampling ``seqs`` their rows. Returns what changed since the
        previous step (None: nothing) and, per row, its sequence's index in ``seqs``."""
        step_index = {seq.seq_id: index for index, seq in enumerate(seqs)}
        rows: list[int | None] = list(self._rows)
        free = [row for row, seq_id in enumerate(rows) if seq_id not in step_index]
        for row in free:
            del self._outputs[self._rows[row]]
            rows[row] = None
        vacated = set(free)
        added: list[AddedRequest] = []
        for seq in seqs:
            output = self._outputs.get(seq.seq_id)
            if output is not None:
                # NOTE: in place: processors hold this list since the sequence was added.
                num_output_tokens = seq.num_output_tokens
                if len(output) < num_output_tokens:
                    output.extend(seq.token_ids[seq.num_prompt_tokens + len(output) :])
                del output[num_output_tokens:]
                continue
            output = self._outputs[seq.seq_id] = seq.output_token_ids
            if free:
                row = free.pop(0)
                rows[row] = seq.seq_id
            else:
                row = len(rows)
                rows.append(seq.seq_id)
            added.append((row, seq.sampling_params, seq.prompt_token_ids, output))
        moved: list[MovedRequest] = []
        while free:
            while rows and rows[-1] is None:
                rows.pop()
            if free[0] >= len(rows):
                break
            row = free.pop(0)
            rows[row] = rows.pop()
            moved.append((len(rows), row, MoveDirectionality.UNIDIRECTIONAL))
        # NOTE: a row refilled by an add or a move is not reported removed, as in vLLM (its
        # `process_dict_updates` handles adds before removals).
        refilled = {row for row, *_ in added} | {destination for _, destination, _ in moved}
        removed = sorted(vacated - refilled, reverse=True)
        self._rows = [seq_id for seq_id in rows if seq_id is not None]
        assert len(self._rows) == len(seqs)
        order = [step_index[seq_id] for seq_id in self._rows]
        if not (removed or added or moved):
            return None, order
        return BatchUpdate(len(seqs), removed, added, moved), order


@dataclass(frozen=True, slots=True)
class StepLogitsProcessing:
    """One step's processing: before the penalties (processors that may change the argmax),
    and on the random-sampling path (the argmax-invariant ones); None where none runs."""

    argmax_changing: LogitsHook | None
    argmax_invariant: LogitsHook | None

    def add_to(self, metadata: SamplingMetadata) -> None:
        """Append to ``metadata``'s processing (after the per-request callables that
        `build_sampling_metadata` set)."""
        if self.argmax_changing is not None:
            metadata.logits_processors = (*metadata.logits_processors, self.argmax_changing)
        if self.argmax_invariant is not None:
            metadata.argmax_invariant_logits_processors = (
                *metadata.argmax_invariant_logits_processors,
                self.argmax_invariant,
            )


class LogitsProcessors:
    """An engine's custom processors, built once, and their persistent batch."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        device = config.device
        vllm_config = config.vllm_config(num_gpu_blocks)
        is_pin_memory = device.type == "cuda"
        processors = [cls(vllm_config, device, is_pin_memory) for cls in config.logits_processors]
        self.processors = processors
        # NOTE: asked once, as vLLM does: the answer decides where a processor runs.
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self.argmax_changing = [p for p in processors if not p.is_argmax_invariant()]
        self.device = device
        self.batch = PersistentBatch()

    def prepare(self, seqs: list[Sequence]) -> StepLogitsProcessing:
        """Tell the processors about this step's sampling ``seqs`` (every step, even one
        that samples nothing, as vLLM calls `update_state` before every forward); return
        the step's processing."""
        batch_update, order = self.batch.update(seqs)
        for processor in self.processors:
            processor.update_state(batch_update)
        index = None
        if order != list(range(len(order))):
            index = torch.tensor(order, dtype=torch.int64, device=self.device)
        return StepLogitsProcessing(
            _in_persistent_order(self.argmax_changing, index),
            _in_persistent_order(self.argmax_invariant, index),
        )


def _in_persistent_order(
    processors: list[LogitsProcessor], index: torch.Tensor | None
) -> LogitsHook | None:
    """``processors`` applied to logits whose row ``index[r]`` is persistent row r (None:
    the rows are already in that order); the result in the step's row order."""
    if not processors:
        return None

    def apply(logits: torch.Tensor) -> torch.Tensor:
        rows = logits if index is None else logits.index_select(0, index)
        for processor in processors:
            rows = processor.apply(rows)
        return rows if index is None else logits.index_copy_(0, index, rows)

    return apply
