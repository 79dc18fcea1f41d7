"""The state of one request and of each of its sequences as they move through the engine.

Most sequences get their next token from the sampler, appended by the scheduler. A request
can instead leave that choice to an owner outside the scheduler
(``Request.tokens_chosen_externally``; the beam search of engine/beam_search.py picks the
next tokens of all its beams at once): a sequence of it that is scored then awaits an
external step (``Sequence.awaits_external_step``), with nothing to compute, until its owner
appends its next tokens and calls `Scheduler.resume`. Such an owner can also reserve places
in ``max_num_seqs`` for the sequences it will start (``Sequence.num_reserved_seqs``).

A pooling request (``Request.pooling_params``) samples nothing: its one sequence computes
the prompt and finishes in the step that computes the prompt's last token, with the
pooler's output instead of a token.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from paged_llm.inputs import LoRARequest
from paged_llm.outputs import RequestMetrics
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from paged_llm.engine.speculation import SequenceDrafter
    from paged_llm.structured_outputs.xgrammar_backend import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Awaiting an external step, without its blocks: it gave them up to let others run,
    # and waits in `Scheduler.paused` until its owner calls `Scheduler.resume`.
    PAUSED = enum.auto()
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


# What the sampling code reads of a pooling request, which samples nothing: no logprobs, no
# prompt logprobs, no stop strings.
PREFILL_ONLY = SamplingParams(max_tokens=1, detokenize=False)

# Per scored position: (token ids, logprobs, rank of the first id); the first id is the
# sampled (or prompt) token, the rest are the most likely tokens in order.
RawLogprobs = tuple[list[int], list[float], int]


class Request:
    """One prompt and its ``n`` sequences, which share the prompt's KV blocks; or, where
    ``tokens_chosen_externally`` is set, the sequences its owner runs (the live beams of a
    beam search, best first)."""

    __slots__ = (
        "bad_words_token_ids",
        "block_hash_seed",
        "lora_request",
        "metrics",
        "output_kind",
        "pooling_params",
        "pools_every_token",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "seqs",
        "tokens_chosen_externally",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float,
        bad_words_token_ids: list[list[int]] | None = None,
        tokens_chosen_externally: bool = False,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        # Where the chain of its blocks' hashes starts: KV computed under one adapter is
        # never shared with a request under another one (or under the base model).
        self.block_hash_seed = (
            None if lora_request is None else b"lora:%d" % lora_request.lora_int_id
        )
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # A pooling request's params; None for a generation.
        self.pooling_params = params if isinstance(params, PoolingParams) else None
        sampling_params = params if isinstance(params, SamplingParams) else PREFILL_ONLY
        self.sampling_params = sampling_params
        # Pooled over every prompt token (MEAN, CLS, ALL), so computed from position 0: the
        # prefix cache holds keys and values, not hidden states.
        self.pools_every_token = (
            self.pooling_params is not None and self.pooling_params.pooling_type != "LAST"
        )
        self.bad_words_token_ids = bad_words_token_ids or []
        # What `OutputProcessor` reports of it before it finishes.
        self.output_kind = output_kind
        # True: `Scheduler.update` appends no sampled token to the request's sequences; an
        # owner outside the scheduler chooses their next tokens (see the module docstring).
        self.tokens_chosen_externally = tokens_chosen_externally
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
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

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
        "awaits_external_step",
        "block_hashes",
        "block_table",
        "draft",
        "drafter",
        "finish_reason",
        "grammar",
        "index",
        "logprobs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_reserved_seqs",
        "pending_forks",
        "pooling_state",
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
        drafter: SequenceDrafter | None = None,
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
        # Places in max_num_seqs that this sequence's owner holds for sequences it will
        # start from it (beams still to fork), so that they always find one.
        self.num_reserved_seqs = 0
        # Scored, with nothing to compute until the owner that chooses its next tokens
        # moves it on (`Scheduler.resume`); only for `Request.tokens_chosen_externally`.
        self.awaits_external_step = False
        self.logprobs: list[RawLogprobs] = []
        # A pooling sequence's pooling of the prompt chunks computed so far, kept by rank 0's
        # runner between steps (opaque here); a chunk from position 0 starts it anew.
        self.pooling_state: object = None
        # Structured outputs: the matcher of this sequence's own tokens (each of the n
        # sequences has its own), or None.
        self.grammar = grammar
        # Speculative decoding: the sequence's n-gram index and acceptance (None: it does
        # not speculate), and the draft tokens the current step verifies after its last
        # token (not in ``token_ids``: they are not its tokens unless accepted).
        self.drafter = drafter
        self.draft: list[int] = []
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

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.name})"
        )
