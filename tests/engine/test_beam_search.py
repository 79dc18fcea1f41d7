"""The engine's beam search driven without a model: a made-up scorer, real scheduling and
block accounting, checked against the reference search and the block pool's invariants."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from functools import cache

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from paged_llm import BeamSearchParams
from paged_llm.config import SchedulerConfig
from paged_llm.engine.beam_search import BeamSearcher, FinishedBeam
from paged_llm.engine.block_manager import BlockManager
from paged_llm.engine.request import EngineRequest
from paged_llm.engine.scheduler import ScheduledBatch, Scheduler
from paged_llm.engine.sequence import Request
from tests.beam_reference import ReferenceBeam, reference_beam_search

VOCAB_SIZE = 20
EOS = 0
EOS_IDS = frozenset({EOS})
MAX_MODEL_LEN = 16


@cache
def fake_logprobs(tokens: tuple[int, ...]) -> tuple[float, ...]:
    """A made-up model: next-token logprobs that depend on the whole sequence only."""
    rng = random.Random(repr(tokens))
    logits = [rng.gauss(0.0, 2.0) for _ in range(VOCAB_SIZE)]
    norm = math.log(sum(math.exp(x) for x in logits))
    return tuple(x - norm for x in logits)


def fake_top(sequences: list[list[int]], count: int) -> list[list[tuple[int, float]]]:
    ranked = [
        sorted(enumerate(fake_logprobs(tuple(tokens))), key=lambda entry: -entry[1])
        for tokens in sequences
    ]
    return [entries[:count] for entries in ranked]


class Engine:
    """The scheduler and beam searcher, stepped as `EngineCore.step` does, with the rows the
    model runner would return for greedy logprobs: the argmax first, then the top tokens."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        prefix_caching: bool = True,
    ) -> None:
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
        )
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, EOS_IDS)
        self.searcher = BeamSearcher(self.scheduler, EOS_IDS, itertools.count())
        self.requests: list[Request] = []
        # The result of each search that is over, by request id.
        self.results: dict[str, list[FinishedBeam]] = {}
        self.num_steps = 0
        self.last_batch = ScheduledBatch()

    def add(self, prompt: list[int], params: BeamSearchParams) -> Request:
        request = self.searcher.add_request(
            EngineRequest(str(len(self.requests)), None, prompt, params), 0, None
        )
        self.requests.append(request)
        return request

    def step(self) -> None:
        batch = self.scheduler.schedule()
        assert batch.seqs, "nothing to run although requests are pending"
        self.last_batch = batch
        holders = [*self.scheduler.running, *self.scheduler.paused]
        assert len(holders) <= self.scheduler.config.max_num_seqs
        self.scheduler.update(batch, [[EOS] for _ in batch.sampling_seqs])
        for seq in batch.sampling_seqs:
            num_top = seq.sampling_params.logprobs
            assert num_top is not None
            (top,) = fake_top([seq.token_ids], num_top)
            ids = [top[0][0]] + [token_id for token_id, _ in top]
            logprobs = [top[0][1]] + [logprob for _, logprob in top]
            seq.logprobs.append((ids, logprobs, 1))
        self.num_steps += 1
        for request, beams in self.searcher.step(batch.sampling_seqs):
            assert request.request_id not in self.results
            self.results[request.request_id] = beams
        self.check_blocks()

    def run(self, max_steps: int = 2000) -> None:
        while self.scheduler.has_unfinished():
            assert self.num_steps < max_steps, "the searches make no progress"
            self.step()

    def check_blocks(self) -> None:
        """Every block is held exactly by the live beams whose tables name it: a pruned or
        finished beam's blocks are free at once."""
        holders: Counter[int] = Counter()
        for request in self.requests:
            state = self.searcher.searches.get(request.request_id)
            assert (state is None) == (request.request_id in self.results)
            if state is not None:
                for beam in state.beams:
                    holders.update(beam.seq.block_table)
        for block in self.block_manager.blocks:
            assert block.ref_count == holders[block.block_id], block
        assert self.block_manager.num_free_blocks == sum(
            1 for block in self.block_manager.blocks if block.ref_count == 0
        )

    def result(self, request: Request) -> list[ReferenceBeam]:
        """The request's beams, best first, once its search is over."""
        beams = self.results.get(request.request_id)
        assert beams is not None, "the search is not over"
        return [
            ReferenceBeam(beam.token_ids, beam.cum_logprob, beam.finish_reason.value)
            for beam in beams
        ]


def assert_same(got: list[ReferenceBeam], expected: list[ReferenceBeam]) -> None:
    assert [(b.tokens, b.finish_reason) for b in got] == [
        (b.tokens, b.finish_reason) for b in expected
    ]
    assert [b.cum_logprob for b in got] == pytest.approx([b.cum_logprob for b in expected])


def test_beams_share_the_prompt_s_full_blocks_and_a_pruned_beam_frees_its_own() -> None:
    engine = Engine(block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks and two tokens
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    request = engine.add(prompt, params)
    engine.step()  # the prompt, then the first beam step forks two beams
    state = engine.searcher.searches[request.request_id]
    assert len(state.beams) == 3
    tables = [beam.seq.block_table for beam in state.beams]
    assert tables[1][:2] == tables[2][:2] == tables[0][:2]
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in tables[0][:2])
    # The forks get a copy of the partial last block, so they compute their new token only.
    assert [beam.seq.num_computed_tokens for beam in state.beams] == [10, 10, 10]
    assert len({table[2] for table in tables}) == 3
    assert engine.block_manager.pending_copies == [
        (tables[0][2], tables[1][2]),
        (tables[0][2], tables[2][2]),
    ]
    copies = engine.block_manager.pending_copies
    engine.step()
    assert engine.last_batch.block_copies == copies  # made before the next forward
    engine.run()
    assert_same(
        engine.result(request),
        reference_beam_search(fake_top, prompt, params, EOS_IDS, MAX_MODEL_LEN),
    )
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_search_ends_at_max_model_len() -> None:
    engine = Engine()
    prompt = list(range(1, 14))
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    request = engine.add(prompt, params)
    engine.run()
    beams = engine.result(request)
    assert all(len(beam.tokens) == MAX_MODEL_LEN for beam in beams)
    assert_same(beams, reference_beam_search(fake_top, prompt, params, EOS_IDS, MAX_MODEL_LEN))


def test_a_cache_that_holds_one_sequence_still_runs_three_beams() -> None:
    """The beams cannot all hold blocks at once: scored ones are paused (and keep their
    scores) so the others can run, and the result does not change."""
    engine = Engine(num_blocks=MAX_MODEL_LEN // 4, block_size=4, max_num_batched_tokens=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    request = engine.add(prompt, params)
    num_paused = 0
    while engine.scheduler.has_unfinished():
        engine.step()
        num_paused = max(num_paused, len(engine.scheduler.paused))
    assert num_paused > 0
    assert_same(
        engine.result(request), reference_beam_search(fake_top, prompt, params, EOS_IDS, 16)
    )
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


request_strategy = st.tuples(
    st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=1, max_size=9),
    st.builds(
        BeamSearchParams,
        beam_width=st.integers(1, 3),
        max_tokens=st.integers(1, 6),
        ignore_eos=st.booleans(),
        length_penalty=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=3),
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 8),
    max_num_batched_tokens=st.integers(1, 24),
    extra_seqs=st.integers(0, 4),
    prefix_caching=st.booleans(),
)
def test_searches_equal_the_reference_under_any_memory_budget_and_batching(
    requests: list[tuple[list[int], BeamSearchParams]],
    block_size: int,
    extra_blocks: int,
    max_num_batched_tokens: int,
    extra_seqs: int,
    prefix_caching: bool,
) -> None:
    """Small caches pause and preempt beams, small budgets chunk them and let some beams wait
    for others; neither may change a result, leak a block or stall."""
    engine = Engine(
        # The KV cache is sized to hold at least one max_model_len sequence.
        num_blocks=-(-MAX_MODEL_LEN // block_size) + extra_blocks,
        block_size=block_size,
        max_num_seqs=max(params.beam_width for _, params in requests) + extra_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefix_caching=prefix_caching,
    )
    added = [engine.add(prompt, params) for prompt, params in requests]
    engine.run()
    for request, (prompt, params) in zip(added, requests, strict=True):
        expected = reference_beam_search(fake_top, prompt, params, EOS_IDS, MAX_MODEL_LEN)
        assert_same(engine.result(request), expected)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.paused
    assert not engine.searcher.searches
