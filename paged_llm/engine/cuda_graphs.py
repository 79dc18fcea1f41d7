"""CUDA graphs of decode-only forward passes, captured at a ladder of batch sizes.

A decode step launches hundreds of small kernels; replaying a captured graph launches
them at once. Inputs live in static buffers; a batch of B sequences replays the
smallest captured size >= B, and its padding rows write nowhere (slot -1) and read one
cached token, so their (discarded) outputs cost nothing but arithmetic.

With ``capture=False`` the same static, padded batches run eagerly: that is how the
padding logic is tested on machines without a GPU.
"""

from __future__ import annotations

import bisect
import collections
import functools
from collections.abc import Callable

import torch
from torch import nn

from paged_llm.engine.batch import HostBatch
from paged_llm.layers.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = {1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs}
    return sorted(size for size in sizes if size <= max_num_seqs)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        # Batches run so far at each size.
        self.replay_counts: collections.Counter[int] = collections.Counter()
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_tables = torch.zeros(
            largest, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self._runs: dict[int, Callable[[], torch.Tensor]] = {}
        pool = None
        # Largest first, so smaller graphs reuse its memory pool.
        for size in reversed(self.sizes):
            metadata = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_tables=self.block_tables[:size],
                query_start_loc_cpu=[],
                seq_lens_cpu=[],
                max_query_len=1,
                # An upper bound, fixed at capture: the kernel reads the real lengths.
                max_seq_len=max_model_len,
                block_size=block_size,
            )
            inputs = (self.input_ids[:size], self.positions[:size], metadata)
            if not capture:
                self._runs[size] = functools.partial(model, *inputs)
                continue
            # Warm-up outside capture: Triton compiles its kernels on first launch.
            model(*inputs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model(*inputs)
            pool = graph.pool()
            self._runs[size] = functools.partial(_replay, graph, hidden)
        if capture:
            torch.cuda.synchronize(device)

    def can_run(self, batch: HostBatch) -> bool:
        return batch.is_decode_only and batch.num_seqs <= self.sizes[-1]

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds ``num_seqs`` sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, batch: HostBatch) -> torch.Tensor:
        """Hidden states ``[B, hidden_size]`` of a decode-only batch."""
        num_seqs = batch.num_seqs
        size = self.size_for(num_seqs)
        self.replay_counts[size] += 1
        self.input_ids[:num_seqs].copy_(torch.from_numpy(batch.input_ids), non_blocking=True)
        self.positions[:num_seqs].copy_(torch.from_numpy(batch.positions), non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(torch.from_numpy(batch.slot_mapping), non_blocking=True)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(torch.from_numpy(batch.seq_lens), non_blocking=True)
        self.seq_lens[num_seqs:size].fill_(1)
        num_blocks = batch.block_tables.shape[1]
        self.block_tables[:num_seqs, :num_blocks].copy_(
            torch.from_numpy(batch.block_tables), non_blocking=True
        )
        return self._runs[size]()[:num_seqs]


def _replay(graph: torch.cuda.CUDAGraph, hidden: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return hidden
