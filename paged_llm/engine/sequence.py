"""The state of one request and of each of its sequences as they move through the engine."""

from __future__ import annotations

import enum
import hashlib
from typing import TYPE_CHECKING

from paged_llm.outputs import RequestMetrics
from paged_llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_llm.engine.beam_search import BeamSearchState
    from paged_llm.structured_outputs.xgrammar_backend import SequenceGrammar


def derive_seed(*parts: int) -> int:
    """A 63-bit seed determined by the given integers (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # A scored beam that gave up its blocks: nothing to compute until the beam search
    # gives it a next token (`Scheduler.parked`).
    PARKED = enum.auto()
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


# Per scored position: (token ids, logprobs, rank of the first id); the first id is the
# sampled (or prompt) token, the rest are the most likely tokens in order.
RawLogprobs = tuple[list[int], list[float], int]


class Request:
    """One prompt and its ``n`` sequences, which share the prompt's KV blocks; or, for a
    beam search (``beam_search`` set), its live beams, best first."""

    __slots__ = (
        "bad_words_token_ids",
        "beam_search",
        "metrics",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "seqs",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        bad_words_token_ids: list[list[int]] | None = None,
        beam_search: BeamSearchState | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.bad_words_token_ids = bad_words_token_ids or []
        self.beam_search = beam_search
        # Shared by the request's sequences: the first token of any of them is the
        # request's first token, the last one to finish finishes the request.
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # Per prompt position from 1 on: its logprobs, or None where it is not scored
        # (before `SamplingParams.prompt_logprobs_start`).
        self.prompt_logprobs: list[RawLogprobs | None] = [None] * max(
            sampling_params.prompt_logprobs_start - 1, 0
        )
        self.seqs: list[Sequence] = []

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and not all positions are scored yet (the
        positions before ``len(prompt_logprobs)`` need no logits)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )


class Sequence:
    """Prompt and generated tokens of one completion, and where its KV cache lives.

    ``num_computed_tokens`` tokens have their keys and values in the cache (blocks
    ``block_table``); the rest of ``token_ids`` still has to run through the model.
    """

    __slots__ = (
        "block_hashes",
        "block_table",
        "finish_reason",
        "grammar",
        "index",
        "logprobs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "pending_forks",
        "request",
        "sampling_params",
        "seed",
        "seq_id",
        "status",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        request: Request,
        seed: int,
        index: int = 0,
        grammar: SequenceGrammar | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.sampling_params = request.sampling_params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Hashes of this sequence's full blocks, in order; token-derived, so they
        # survive preemption.
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Sibling sequences (n > 1) that start once this one has computed the prompt.
        self.pending_forks: list[Sequence] = []
        self.logprobs: list[RawLogprobs] = []
        # Structured outputs: the matcher of this sequence's own tokens (each of the n
        # sequences has its own), or None.
        self.grammar = grammar
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def metrics(self) -> RequestMetrics:
        return self.request.metrics

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def awaits_beam_step(self) -> bool:
        """A beam whose last token is scored: it waits, with nothing to compute, until the
        other beams of its request are scored too and the beam search picks its next
        tokens (engine/beam_search.py)."""
        return len(self.logprobs) > self.num_output_tokens

    @property
    def num_seqs_to_fork(self) -> int:
        """Sequences this one may still start: its ``n > 1`` siblings not forked yet; for
        the best beam of a beam search, the beams its request lacks of ``beam_width``
        (all but one before the first step), so that forks always find a place in
        ``max_num_seqs``."""
        state = self.request.beam_search
        if state is None:
            return len(self.pending_forks)
        if state.beams[0].seq is not self:
            return 0
        return state.params.beam_width - len(state.beams)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.name})"
        )
