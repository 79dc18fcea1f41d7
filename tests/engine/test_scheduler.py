"""The scheduler, driven without a model: fake tokens, real block accounting."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_llm.config import SchedulerConfig
from paged_llm.engine.block_manager import BlockManager
from paged_llm.engine.scheduler import ScheduledBatch, Scheduler
from paged_llm.engine.sequence import Sequence, SequenceStatus
from paged_llm.lora.request import LoRARequest
from tests.engine.helpers import make_seq

EOS = 2
FILLER = 7


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
    max_loras: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        chunked_prefill=chunked_prefill,
        max_loras=max_loras,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), frozenset({EOS}))


def make_prompt_seq(
    num_prompt_tokens: int, lora_request: LoRARequest | None = None, **params: object
) -> Sequence:
    return make_seq(
        [10 + (i % 50) for i in range(num_prompt_tokens)], lora_request=lora_request, **params
    )


def step(scheduler: Scheduler, token: int = FILLER) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = scheduler.schedule()
    return batch, scheduler.update(batch, [[token] for _ in batch.sampling_seqs])


def test_long_prompt_is_chunked_and_decodes_run_alongside() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    short, long = make_prompt_seq(3, max_tokens=4), make_prompt_seq(20, max_tokens=2)
    scheduler.add(short)
    scheduler.add(long)
    batch, _ = step(scheduler)
    assert batch.num_scheduled_tokens == [3, 5]
    batch, _ = step(scheduler)
    # The decode of `short` comes first, then the next chunk of `long`.
    assert batch.seqs == [short, long] and batch.num_scheduled_tokens == [1, 7]
    assert long.num_output_tokens == 0 and short.num_output_tokens == 2


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=24, max_model_len=24, chunked_prefill=False, prefix_caching=False
    )
    first, second = make_prompt_seq(20, max_tokens=2), make_prompt_seq(10, max_tokens=2)
    scheduler.add(first)
    scheduler.add(second)
    batch, _ = step(scheduler)
    # Chunking would have given `second` the 4 tokens left; it waits for a step it fits in.
    assert batch.seqs == [first] and batch.num_scheduled_tokens == [20]
    batch, _ = step(scheduler)
    assert batch.seqs == [first, second] and batch.num_scheduled_tokens == [1, 10]


def test_fcfs_admission_under_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_prompt_seq(4, max_tokens=3) for _ in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    admitted: list[Sequence] = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler)
        admitted.extend(s for s in batch.seqs if s not in admitted)
        assert len(batch.seqs) <= 2
    assert admitted == seqs


def test_a_prompt_waits_a_step_for_the_blocks_another_computes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    shared = list(range(100, 108))  # two blocks of 4
    first, sharer, other, late_sharer = (
        make_seq(tokens, max_tokens=2)
        for tokens in (
            [*shared, 1, 2, 3],
            [*shared, 4, 5],
            list(range(200, 211)),
            [*shared, 6],
        )
    )
    for seq in (first, sharer, other, late_sharer):
        scheduler.add(seq)
    batch, _ = step(scheduler)
    # The sharers would compute the shared blocks beside `first`: they wait, in order.
    assert batch.seqs == [first, other]
    assert list(scheduler.waiting) == [sharer, late_sharer]
    batch, _ = step(scheduler)
    assert batch.seqs == [first, other, sharer, late_sharer]
    assert [sharer.num_cached_tokens, late_sharer.num_cached_tokens] == [8, 8]
    assert batch.num_scheduled_tokens == [1, 1, 2, 1]
    assert scheduler.block_manager.prefix_cache_hit_tokens == 16


def test_a_prompt_waits_for_the_blocks_a_chunked_prefill_computes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    long = make_seq(list(range(100, 126)), max_tokens=2)  # chunks of 10, 10 and 6 tokens
    sharer = make_seq([*range(100, 124), 1, 2], max_tokens=2)  # its first six blocks
    scheduler.add(long)
    scheduler.add(sharer)
    while sharer.status is SequenceStatus.WAITING:
        batch, _ = step(scheduler)
        assert batch.seqs[0] is long
    # The last chunk left room in the budget while it filled the sixth block: the sharer
    # waited for that block too, then took all six from the cache.
    assert sharer.num_cached_tokens == 24
    while scheduler.has_unfinished():
        step(scheduler)


def test_preemption_takes_the_most_recently_admitted() -> None:
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each and fill the pool
    # (they are the same prompt: without prefix caching they share nothing).
    scheduler = make_scheduler(num_blocks=6, max_model_len=16, prefix_caching=False)
    first, second, third = (make_prompt_seq(7, max_tokens=8, ignore_eos=True) for _ in range(3))
    for seq in (first, second, third):
        scheduler.add(seq)
    step(scheduler)  # prefill all three (7 tokens in 2 blocks each)
    step(scheduler)  # decode position 7: the second blocks are now full
    batch, _ = step(scheduler)  # `first` needs a third block: `third` must go
    assert scheduler.num_preemptions == 1
    assert third.status is SequenceStatus.WAITING and scheduler.waiting[0] is third
    assert third.num_computed_tokens == 0 and third.block_table == []
    assert third.num_output_tokens == 2, "generated tokens are kept"
    assert batch.seqs == [first, second]
    while scheduler.has_unfinished():
        step(scheduler)
    assert all(s.num_output_tokens == 8 for s in (first, second, third))


def test_stop_conditions() -> None:
    scheduler = make_scheduler()
    eos = make_prompt_seq(3, max_tokens=10)
    ignore = make_prompt_seq(3, max_tokens=3, ignore_eos=True)
    stop_token = make_prompt_seq(3, max_tokens=10, stop_token_ids=[EOS], ignore_eos=True)
    min_tokens = make_prompt_seq(3, max_tokens=10, min_tokens=2)
    for seq in (eos, ignore, stop_token, min_tokens):
        scheduler.add(seq)
    _, finished = step(scheduler, token=EOS)
    assert finished == [eos, stop_token]
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop_token.finish_reason, stop_token.stop_reason) == ("stop", EOS)
    _, finished = step(scheduler, token=EOS)
    assert finished == [min_tokens] and min_tokens.num_output_tokens == 2
    _, finished = step(scheduler, token=EOS)
    assert finished == [ignore] and ignore.finish_reason == "length"


def test_max_model_len_ends_generation() -> None:
    scheduler = make_scheduler(max_model_len=10)
    seq = make_prompt_seq(6, max_tokens=None)
    scheduler.add(seq)
    while scheduler.has_unfinished():
        step(scheduler)
    assert seq.num_tokens == 10 and seq.finish_reason == "length"


def test_a_sequence_awaiting_an_external_step_is_skipped_paused_and_resumed() -> None:
    """A request whose tokens an owner outside the scheduler chooses (beam search uses
    this): a scored sequence gets no token and has nothing to compute until `resume`; when
    its blocks are needed it is paused rather than queued, and it keeps its places in
    max_num_seqs, the one it reserved for a sequence it will start included."""
    # 4 blocks of 4 tokens; no prefix caching, so a recompute finds nothing cached.
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=3, prefix_caching=False)
    owned = make_prompt_seq(7)  # 2 blocks
    owned.request.tokens_chosen_externally = True
    owned.num_reserved_seqs = 1
    scheduler.add(owned)
    batch, finished = step(scheduler)
    assert batch.seqs == [owned] and not finished
    assert owned.awaits_external_step and owned.num_output_tokens == 0
    other = make_prompt_seq(12, max_tokens=2, ignore_eos=True)  # 3 blocks, then a 4th
    third = make_prompt_seq(2, max_tokens=1, ignore_eos=True)
    scheduler.add(other)
    scheduler.add(third)
    batch, _ = step(scheduler)
    # `owned` has nothing to compute and holds the blocks `other` needs: it gives them up.
    assert batch.seqs == [other]
    assert owned.status is SequenceStatus.PAUSED and scheduler.paused == [owned]
    assert owned.block_table == [] and owned.awaits_external_step
    # `owned` and the place it reserved leave no room for `third` in max_num_seqs.
    assert list(scheduler.waiting) == [third]
    owned.token_ids.append(FILLER)  # the owner's step
    scheduler.resume(owned)
    assert not owned.awaits_external_step and not scheduler.paused
    assert list(scheduler.waiting) == [owned, third]
    batch, finished = step(scheduler)  # `other` takes the last block and finishes
    assert batch.seqs == [other] and finished == [other]
    batch, _ = step(scheduler)
    # Recomputed from the start, with the owner's token, then scored again.
    assert batch.seqs == [owned, third] and batch.num_scheduled_tokens == [8, 2]
    assert owned.awaits_external_step and owned.num_tokens == 8
    scheduler.release(owned)
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 12), min_size=12, max_size=12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 20),
    shared_prefix=st.booleans(),
)
def test_every_request_finishes_within_limits_and_leaks_nothing(
    prompt_lens: list[int],
    max_tokens: list[int],
    max_num_seqs: int,
    budget: int,
    block_size: int,
    spare_blocks: int,
    shared_prefix: bool,
) -> None:
    max_model_len = 56
    scheduler = make_scheduler(
        # The pool always holds one full-length sequence (the engine checks this at start).
        num_blocks=-(-max_model_len // block_size) + spare_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    seqs = [
        make_prompt_seq(n, max_tokens=m, ignore_eos=True)
        for n, m in zip(prompt_lens, max_tokens, strict=False)
    ]
    if shared_prefix:
        for seq in seqs:
            seq.token_ids[: min(16, seq.num_prompt_tokens)] = [3] * min(16, seq.num_prompt_tokens)
    for seq in seqs:
        scheduler.add(seq)
    admitted: list[Sequence] = []
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        batch, _ = step(scheduler)
        assert batch.num_tokens <= budget
        assert len(batch.seqs) <= max_num_seqs and len(scheduler.running) <= max_num_seqs
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        assert all(n >= 1 for n in batch.num_scheduled_tokens)
        admitted.extend(s for s in batch.seqs if s not in admitted)
    assert not scheduler.has_unfinished()
    # First come, first served, except that a prompt waits a step for blocks another
    # sequence computes: one overtaken shares its first block with another sequence.
    order = {id(seq): i for i, seq in enumerate(admitted)}
    for i, seq in enumerate(seqs):
        if any(order[id(later)] < order[id(seq)] for later in seqs[i + 1 :]):
            first_block = seq.token_ids[:block_size]
            assert len(first_block) == block_size
            assert any(o is not seq and o.token_ids[:block_size] == first_block for o in seqs)
    for seq, m in zip(seqs, max_tokens, strict=False):
        assert seq.is_finished
        assert seq.num_output_tokens == min(m, max_model_len - seq.num_prompt_tokens)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_requests_of_adapters_without_a_place_wait_in_their_order() -> None:
    """max_loras=1: the adapter running first takes its later requests along; the others
    wait, keeping their order, and get the place in turn once it frees."""
    scheduler = make_scheduler(max_loras=1)
    adapters = {name: LoRARequest(name, i + 1, name) for i, name in enumerate("abc")}
    order = ["a", "b", None, "a", "c", "b"]
    seqs = [make_prompt_seq(4, max_tokens=2, lora_request=adapters.get(name)) for name in order]
    for seq in seqs:
        scheduler.add(seq)
    admitted: list[str | None] = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler)
        running = {seq.request.lora_int_id for seq in scheduler.running} - {0}
        assert len(running) <= 1
        admitted += [order[seqs.index(seq)] for seq in batch.seqs if seq.num_output_tokens == 1]
    assert admitted == ["a", None, "a", "b", "b", "c"]
