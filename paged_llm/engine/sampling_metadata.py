"""Per-step sampling tensors, one row per token drawn this step: one per sampling sequence,
and for a speculating sequence one more per draft token (`SamplingRow`).

Common parameters become one tensor per field. Rare features (allowed tokens, bad words,
logit bias, min_tokens, per-request logits processors) are applied by looping over only
the rows that use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from paged_llm.engine.batch import padded_array
from paged_llm.engine.sequence import Sequence
from paged_llm.layers.sampler import LogitsHook, SamplingMetadata
from paged_llm.logits_processors import apply_to_rows, bind_request_logits_processor
from paged_llm.structured_outputs.xgrammar_backend import only_stop_tokens_allowed


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """A token to draw: ``seq``'s next token after the first ``num_drafted`` tokens of its
    draft, which count as its output for the row (penalties, bans and min_tokens see them),
    and whose position picks the row's uniform."""

    seq: Sequence
    num_drafted: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        output = self.seq.output_token_ids
        return output + self.seq.draft[: self.num_drafted] if self.num_drafted else output

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.num_drafted


def sampling_rows(seqs: list[Sequence]) -> list[SamplingRow]:
    """The rows of these sampling sequences: each one's, then one per draft token."""
    return [SamplingRow(seq, drafted) for seq in seqs for drafted in range(1 + len(seq.draft))]


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab_size]`` occurrences of each token in each row."""
    ids = torch.from_numpy(padded_array(rows, vocab_size, np.int64)).to(device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _banned_next_tokens(row: SamplingRow) -> list[int]:
    """Last tokens of bad words whose other tokens the row's sequence has just generated."""
    output = row.output_token_ids
    banned = []
    for word in row.seq.request.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned


def build_sampling_metadata(
    rows: list[SamplingRow],
    vocab_size: int,
    eos_token_ids: frozenset[int],
    device: torch.device,
    grammar_bitmask: torch.Tensor | None = None,
) -> SamplingMetadata:
    """``grammar_bitmask``: the step's structured-output bitmask (`grammar_bitmask`), which
    the runner applies to the logits; here it decides whether min_tokens may still hold
    EOS back, and tells the sampler to look for rows it leaves without a token."""
    seqs = [row.seq for row in rows]
    params = [seq.sampling_params for seq in seqs]
    num_rows = len(rows)

    def row_tensor(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = SamplingMetadata(
        temperature=row_tensor(
            [0.0 if p.is_greedy else p.temperature for p in params], torch.float32
        ),
        seeds=row_tensor([seq.seed for seq in seqs], torch.int64),
        counters=row_tensor([row.num_output_tokens for row in rows], torch.int64),
        all_greedy=all(p.is_greedy for p in params),
        grammar_masked=grammar_bitmask is not None,
    )
    if any(p.top_k > 0 for p in params):
        metadata.top_k = row_tensor([p.top_k for p in params], torch.int64)
    if any(p.top_p < 1.0 for p in params):
        metadata.top_p = row_tensor([p.top_p for p in params], torch.float32)
    if any(p.min_p > 0.0 for p in params):
        metadata.min_p = row_tensor([p.min_p for p in params], torch.float32)

    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_frequency = any(p.frequency_penalty != 0.0 for p in params)
    use_presence = any(p.presence_penalty != 0.0 for p in params)
    if use_repetition or use_frequency or use_presence:
        metadata.output_token_counts = _token_counts(
            [row.output_token_ids for row in rows], vocab_size, device
        )
    if use_repetition:
        metadata.repetition_penalty = row_tensor(
            [p.repetition_penalty for p in params], torch.float32
        )
        metadata.prompt_token_mask = (
            _token_counts([seq.prompt_token_ids for seq in seqs], vocab_size, device) > 0
        )
    if use_frequency:
        metadata.frequency_penalty = row_tensor(
            [p.frequency_penalty for p in params], torch.float32
        )
    if use_presence:
        metadata.presence_penalty = row_tensor([p.presence_penalty for p in params], torch.float32)

    banned: torch.Tensor | None = None
    for row, (sampling_row, seq, p) in enumerate(zip(rows, seqs, params, strict=True)):
        ban: list[int] = []
        if sampling_row.num_output_tokens < p.min_tokens:
            ban.extend(p.stop_token_ids)
            # NOTE: once the grammar can only end, min_tokens yields to it: banning EOS
            # too would leave no token to draw.
            if not p.ignore_eos and not (
                grammar_bitmask is not None
                and seq.grammar is not None
                and only_stop_tokens_allowed(grammar_bitmask[row], eos_token_ids, vocab_size)
            ):
                ban.extend(eos_token_ids)
        if seq.request.bad_words_token_ids:
            ban.extend(_banned_next_tokens(sampling_row))
        if not ban and p.allowed_token_ids is None:
            continue
        if banned is None:
            banned = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        if p.allowed_token_ids is not None:
            banned[row] = True
            banned[row, p.allowed_token_ids] = False
        if ban:
            banned[row, ban] = True
    metadata.banned_tokens = banned

    if any(p.logit_bias for p in params):
        bias = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        for row, p in enumerate(params):
            if p.logit_bias:
                bias[row, list(p.logit_bias)] = row_tensor(
                    list(p.logit_bias.values()), torch.float32
                )
        metadata.logit_bias = bias

    if any(p.logits_processors for p in params):
        metadata.logits_processors = (_request_logits_processors(rows),)

    requested = [p.logprobs for p in params if p.logprobs is not None]
    if requested:
        metadata.max_num_logprobs = -1 if -1 in requested else max(requested)
    return metadata


def _request_logits_processors(rows: list[SamplingRow]) -> LogitsHook:
    """The `SamplingParams.logits_processors` of the rows that have them, applied in order
    to those rows alone."""
    bound: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = []
    for index, row in enumerate(rows):
        processors = row.seq.sampling_params.logits_processors
        if processors:
            output = row.output_token_ids
            bound.extend(
                (index, bind_request_logits_processor(fn, row.seq.prompt_token_ids, output))
                for fn in processors
            )
    return lambda logits: apply_to_rows(logits, bound)
