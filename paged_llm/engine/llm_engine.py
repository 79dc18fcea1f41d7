"""The engine loop: requests in, one scheduled step at a time, finished sequences out."""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass

from paged_llm.config import EngineConfig
from paged_llm.engine.block_manager import BlockManager
from paged_llm.engine.model_runner import ModelRunner
from paged_llm.engine.scheduler import Scheduler, SchedulerConfig
from paged_llm.engine.sequence import Sequence
from paged_llm.sampling_params import SamplingParams


def derive_seed(*parts: int) -> int:
    """A 63-bit seed determined by the given integers (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class EngineMetrics:
    """Counters over the engine's lifetime."""

    num_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were found in the prefix cache."""
        if self.prefix_cache_queried_tokens == 0:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(
            self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                eos_token_ids=eos_token_ids,
            ),
            self.block_manager,
        )
        self._seq_ids = itertools.count()
        self._num_requests = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """Queue a validated request. Without a seed of its own, its draws are seeded from
        the engine seed and the request's arrival order, so a rerun reproduces them."""
        serial = self._num_requests
        self._num_requests += 1
        self._num_prompt_tokens += len(prompt_token_ids)
        seed = params.seed if params.seed is not None else derive_seed(self.config.seed, serial)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            seed=derive_seed(seed, 0),
            arrival_time=time.time(),
        )
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Schedule, run and account one step; return the sequences it finished."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            raise RuntimeError(
                "The scheduler found nothing to run although requests are pending; "
                "this is a bug in paged_llm."
            )
        sampled = self.model_runner.execute(batch)
        self._num_generated_tokens += len(sampled)
        return self.scheduler.update(batch, sampled)

    def get_metrics(self) -> EngineMetrics:
        return EngineMetrics(
            num_requests=self._num_requests,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.block_manager.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.block_manager.prefix_cache_hit_tokens,
        )

    def shutdown(self) -> None:
        self.model_runner.shutdown()
