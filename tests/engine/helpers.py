"""Sequences for engine tests that run without a model, an interrupter and the block
pool's invariants."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from paged_llm.engine.scheduler import Scheduler
from paged_llm.engine.sequence import Request, Sequence
from paged_llm.lora.request import LoRARequest
from paged_llm.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(
    prompt_token_ids: list[int], *, lora_request: LoRARequest | None = None, **params: object
) -> Sequence:
    """A fresh single-sequence request over these prompt tokens."""
    seq_id = next(_ids)
    request = Request(
        str(seq_id),
        None,
        list(prompt_token_ids),
        SamplingParams(**params),
        0.0,
        lora_request=lora_request,
    )
    request.seqs = [Sequence(seq_id, request, seed=0)]
    return request.seqs[0]


class Interrupter:
    """Raises KeyboardInterrupt at the k-th 'line' event inside one code object."""

    def __init__(self, code: CodeType, k: int) -> None:
        self.code, self.k, self.count, self.fired = code, k, 0, False

    def _global(self, frame: FrameType, event: str, arg: object) -> Any:
        return self._local if frame.f_code is self.code else None

    def _local(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "line" and not self.fired:
            self.count += 1
            if self.count == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self._local

    def run(self, action: Callable[[], None]) -> bool:
        """Run ``action``; True if it was interrupted."""
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            action()
        except KeyboardInterrupt:
            assert self.fired
        finally:
            sys.settrace(previous)
        return self.fired


def assert_pool_consistent(scheduler: Scheduler) -> None:
    """Each block is free with ref count 0 or held by running sequences; links and map agree."""
    bm = scheduler.block_manager
    owners = Counter(block_id for seq in scheduler.running for block_id in seq.block_table)
    assert all(not seq.block_table for seq in scheduler.waiting)
    for block in bm.blocks:
        assert block.ref_count == owners[block.block_id] >= 0
    free = list(bm.free_queue)
    assert len(free) == len(set(map(id, free))) == bm.num_free_blocks
    assert set(map(id, free)) == {id(b) for b in bm.blocks if b.ref_count == 0}
    # The backward links mirror the forward ones.
    for prev_block, block in itertools.pairwise([bm.free_queue._head, *free]):
        assert block.prev_free is prev_block
    assert bm.free_queue._tail.prev_free is (free[-1] if free else bm.free_queue._head)
    for block_hash, block in bm.cached_blocks.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in bm.blocks) == len(bm.cached_blocks)
