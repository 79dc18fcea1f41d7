"""The state of one sequence as it moves through the engine."""

from __future__ import annotations

import enum

from paged_llm.outputs import RequestMetrics
from paged_llm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


class Sequence:
    """Prompt and generated tokens of one completion, and where its KV cache lives.

    ``num_computed_tokens`` tokens have their keys and values in the cache (blocks
    ``block_table``); the rest of ``token_ids`` still has to run through the model.
    """

    __slots__ = (
        "block_hashes",
        "block_table",
        "finish_reason",
        "index",
        "metrics",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
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
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        arrival_time: float,
        index: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Hashes of this sequence's full blocks, in order; token-derived, so they
        # survive preemption.
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
