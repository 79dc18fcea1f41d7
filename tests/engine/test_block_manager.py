"""The block pool: unit tests and hypothesis-driven invariants."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_llm.engine.block_manager import BlockManager, FreeBlockQueue, KVCacheBlock
from paged_llm.engine.sequence import Sequence
from tests.engine.helpers import make_seq


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does on admission: look up the prefix, then allocate the rest."""
    hits = bm.find_cached_prefix(seq)
    num_cached = len(hits) * bm.block_size
    if not bm.allocate_slots(seq, seq.num_tokens - num_cached, hits):
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return True


def test_free_queue_removes_from_the_middle_and_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert len(queue) == 4


def test_identical_prefix_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))  # three full blocks
    assert admit(bm, first)
    second = make_seq(list(range(12)))
    hits = bm.find_cached_prefix(second)
    # All 12 tokens are cached, but the last block is recomputed for logits.
    assert [b.block_id for b in hits] == first.block_table[:2]
    assert bm.allocate_slots(second, 4, hits)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.blocks[i].ref_count for i in first.block_table] == [2, 2, 1]


def test_freed_blocks_stay_cached_until_reused_tail_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])  # three full blocks and one partial
    assert admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == 4
    # The tail is evicted first: the partial block, then the third full block.
    assert [b.block_id for b in bm.free_queue] == table[::-1]
    again = make_seq([1, 2, 3, 4, 5, 6, 9])
    assert [b.block_id for b in bm.find_cached_prefix(again)] == table[:3]
    other = make_seq([8, 8])
    assert bm.allocate_slots(other, 2)
    assert other.block_table == [table[3]]
    assert len(bm.cached_blocks) == 3


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(20)))
    assert not bm.allocate_slots(seq, 20)
    assert seq.block_table == [] and bm.num_free_blocks == 3


def test_reviving_a_freed_cached_block_counts_against_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    first = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, first)
    bm.free(first)
    # The 2 cached blocks sit in the free queue: reviving them takes 2 of the 3 free
    # blocks, so 2 new blocks on top do not fit, 1 does.
    second = make_seq([1, 2, 3, 4, 5, 6])
    hits = bm.find_cached_prefix(second)
    assert len(hits) == 2
    assert not bm.allocate_slots(second, 2 + 2, hits)
    assert bm.allocate_slots(second, 2, hits)
    assert bm.num_free_blocks == 0


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    assert admit(bm, make_seq([1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert bm.cached_blocks == {}


def test_hash_chains_depend_on_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    assert admit(bm, make_seq([1, 2, 3, 4, 0]))
    # Same second block, different first block: no hit at all.
    assert bm.find_cached_prefix(make_seq([9, 9, 3, 4, 0])) == []


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, appends and frees; the pool's invariants hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
        self.live: list[Sequence] = []

    # A tiny alphabet makes shared prefixes (and cache hits) common.
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30))
    def admit(self, tokens: list[int]) -> None:
        seq = make_seq(tokens)
        computed = [s for s in self.live if s.num_computed_tokens >= s.num_tokens]
        if admit(self.bm, seq):
            self.live.append(seq)
            # A repeated prefix maps to the same physical blocks.
            for other in computed:
                shared = 0
                while (
                    shared < min(len(other.block_table), len(seq.block_table))
                    and (shared + 1) * 4 <= min(seq.num_tokens - 1, other.num_tokens)
                    and other.token_ids[: (shared + 1) * 4] == seq.token_ids[: (shared + 1) * 4]
                    and other.block_hashes[shared] in self.bm.cached_blocks
                    and self.bm.cached_blocks[other.block_hashes[shared]].block_id
                    == other.block_table[shared]
                ):
                    assert seq.block_table[shared] == other.block_table[shared]
                    shared += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 9))
    def append(self, data: st.DataObject, count: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        new_tokens = data.draw(st.lists(st.integers(0, 2), min_size=count, max_size=count))
        seq.token_ids.extend(new_tokens)
        if self.bm.allocate_slots(seq, count):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
        else:
            del seq.token_ids[-count:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.live.remove(seq)

    @invariant()
    def pool_is_consistent(self) -> None:
        bm = self.bm
        owners = Counter(block_id for seq in self.live for block_id in seq.block_table)
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "block owned twice"
            assert len(seq.block_table) == -(-seq.num_tokens // 4)
        for block in bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == owners[block.block_id]
        free = list(bm.free_queue)
        assert len(free) == len({b.block_id for b in free}) == bm.num_free_blocks
        assert {b.block_id for b in free} == {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert len(free) + sum(1 for b in bm.blocks if b.ref_count > 0) == bm.num_blocks
        for block_hash, block in bm.cached_blocks.items():
            assert block.block_hash == block_hash
        assert sum(1 for b in bm.blocks if b.block_hash is not None) == len(bm.cached_blocks)

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_hit_rate_counters(block_size: int) -> None:
    bm = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=True)
    tokens = list(range(40))
    assert admit(bm, make_seq(tokens))
    assert admit(bm, make_seq(tokens))
    hit = (len(tokens) - 1) // block_size * block_size
    assert bm.prefix_cache_hit_tokens == hit
    assert bm.prefix_cache_queried_tokens == 2 * len(tokens)
