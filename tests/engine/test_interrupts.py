"""A KeyboardInterrupt anywhere in the block pool's bookkeeping, then `abort_all`.

Notebook users interrupt `generate` and reuse the LLM, whose generate loop calls
`Scheduler.abort_all` on the way out; afterwards the pool must be whole again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from paged_llm.config import SchedulerConfig
from paged_llm.engine.block_manager import BlockManager, FreeBlockQueue
from paged_llm.engine.scheduler import Scheduler
from paged_llm.engine.sequence import Request, Sequence
from paged_llm.sampling_params import SamplingParams
from tests.engine.helpers import Interrupter, assert_pool_consistent

BLOCK_SIZE = 2
NUM_BLOCKS = 12
MUTATIONS: dict[str, Callable[..., Any]] = {
    "allocate_slots": BlockManager.allocate_slots,
    "fork": BlockManager.fork,
    "free": BlockManager.free,
    "cache_full_blocks": BlockManager.cache_full_blocks,
    "_evict": BlockManager._evict,
    "FreeBlockQueue.append": FreeBlockQueue.append,
    "FreeBlockQueue.popleft": FreeBlockQueue.popleft,
    "FreeBlockQueue.remove": FreeBlockQueue.remove,
}
_ids = itertools.count()


def make_request(prompt_token_ids: list[int], n: int = 1, max_tokens: int = 4) -> Sequence:
    """The parent sequence of a request with ``n`` sequences, as `EngineCore` builds it."""
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    request = Request(str(next(_ids)), None, list(prompt_token_ids), params, 0.0)
    request.seqs = [Sequence(next(_ids), request, seed=0, index=i) for i in range(n)]
    request.seqs[0].pending_forks = request.seqs[1:]
    return request.seqs[0]


def make_scheduler() -> Scheduler:
    # A pool a little over one max_model_len sequence: preemption and eviction are common.
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=20)
    return Scheduler(
        config, BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True), frozenset()
    )


def step(scheduler: Scheduler) -> None:
    batch = scheduler.schedule()
    scheduler.update(batch, [[5] for _ in batch.sampling_seqs])


def assert_repaired(scheduler: Scheduler) -> None:
    """After `abort_all`: nothing held, everything consistent, the whole pool allocatable."""
    assert not scheduler.has_unfinished()
    assert_pool_consistent(scheduler)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    everything = make_request([9] * (NUM_BLOCKS * BLOCK_SIZE))
    assert bm.allocate_slots(everything, everything.num_tokens)
    assert sorted(everything.block_table) == list(range(NUM_BLOCKS))
    bm.free(everything)
    assert_pool_consistent(scheduler)


def workload(scheduler: Scheduler) -> None:
    """Shared prefixes (cache hits, revived and evicted blocks), a fork, preemptions."""
    prompts = [[1] * 7, [1] * 7 + [2] * 3, [1] * 5, [3, 4] * 4, [1] * 7]
    for i, prompt in enumerate(prompts):
        scheduler.add(make_request(prompt, n=2 if i == 1 else 1, max_tokens=6))
    for _ in range(200):
        if not scheduler.has_unfinished():
            return
        step(scheduler)
    raise AssertionError("the workload did not finish")


def test_the_workload_exercises_every_mutation() -> None:
    scheduler = make_scheduler()
    workload(scheduler)
    assert scheduler.num_preemptions > 0
    assert scheduler.block_manager.prefix_cache_hit_tokens > 0
    for name, method in MUTATIONS.items():
        assert Interrupter(method.__code__, 1).run(lambda: workload(make_scheduler())), name


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_an_interrupt_at_any_line_is_repaired_by_abort_all(name: str) -> None:
    code = MUTATIONS[name].__code__
    for k in itertools.count(1):
        scheduler = make_scheduler()
        if not Interrupter(code, k).run(lambda s=scheduler: workload(s)):
            break
        scheduler.abort_all()
        assert_repaired(scheduler)
        # The engine is usable again: the same workload runs to the end.
        workload(scheduler)
        assert scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert k > 10, "the interrupt never landed"


operations = st.one_of(
    st.tuples(
        st.just("add"),
        st.lists(st.integers(0, 1), min_size=1, max_size=14),
        st.integers(1, 2),
    ),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort")),
    st.tuples(st.just("interrupt"), st.sampled_from(list(MUTATIONS)), st.integers(1, 60)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operations, max_size=30))
def test_random_interleavings_with_interrupts_keep_the_pool_consistent(
    ops: list[tuple[Any, ...]],
) -> None:
    scheduler = make_scheduler()
    for op in ops:
        if op[0] == "add":
            scheduler.add(make_request(op[1], n=op[2]))
        elif op[0] == "step":
            step(scheduler)
        else:
            # An interrupt that lands is followed by the generate loop's abort_all.
            interrupted = op[0] == "interrupt" and Interrupter(
                MUTATIONS[op[1]].__code__, op[2]
            ).run(lambda: step(scheduler))
            if op[0] == "abort" or interrupted:
                scheduler.abort_all()
                assert_repaired(scheduler)
        assert_pool_consistent(scheduler)
