"""Pooling sequences in the scheduler, without a model: prefill only, finished in the step
that computes the prompt's last token, blocks freed at once, and computed from position 0
when they pool every token."""

from __future__ import annotations

import itertools

from paged_llm.engine.sequence import Request, Sequence, SequenceStatus
from paged_llm.pooling_params import PoolingParams
from tests.engine.helpers import assert_pool_consistent
from tests.engine.test_scheduler import make_prompt_seq, make_scheduler, step

_ids = itertools.count(10_000)


def make_pooling_seq(num_prompt_tokens: int, pooling_type: str = "LAST") -> Sequence:
    seq_id = next(_ids)
    params = PoolingParams(task="embed", pooling_type=pooling_type)
    request = Request(
        str(seq_id), None, [10 + (i % 50) for i in range(num_prompt_tokens)], params, 0.0
    )
    request.seqs = [Sequence(seq_id, request, seed=0)]
    return request.seqs[0]


def test_a_pooling_sequence_is_chunked_never_samples_and_finishes_with_its_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    pooled, generated = make_pooling_seq(13), make_prompt_seq(3, max_tokens=3)
    scheduler.add(pooled)
    scheduler.add(generated)
    batch, finished = step(scheduler)
    assert batch.seqs == [pooled] and batch.pooling_seqs == [pooled]
    assert batch.samples == [False] and batch.sampling_seqs == [] and finished == []
    batch, finished = step(scheduler)
    assert batch.seqs == [pooled, generated] and batch.num_scheduled_tokens == [5, 3]
    assert batch.samples == [False, True] and batch.sampling_seqs == [generated]
    # It finished in the step that computed its last prompt token, with no token appended,
    # and gave its blocks back at once.
    assert finished == [pooled] and pooled.status is SequenceStatus.FINISHED
    assert pooled.num_tokens == 13 and pooled.num_output_tokens == 0
    assert pooled.block_table == [] and scheduler.running == [generated]
    assert_pool_consistent(scheduler)


def test_last_pooling_reads_the_prefix_cache_and_every_token_pooling_does_not() -> None:
    scheduler = make_scheduler(block_size=4)
    first = make_pooling_seq(12)
    scheduler.add(first)
    step(scheduler)
    last, mean = make_pooling_seq(12), make_pooling_seq(12, "MEAN")
    scheduler.add(last)
    scheduler.add(mean)
    batch, finished = step(scheduler)
    # LAST recomputes only the last token's block; MEAN computes the whole prompt.
    assert batch.num_scheduled_tokens == [4, 12]
    assert last.num_cached_tokens == 8 and mean.num_cached_tokens == 0
    assert finished == [last, mean]
    assert_pool_consistent(scheduler)
