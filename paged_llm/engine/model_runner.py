"""Runs one scheduled step through the model: batch tensors in, sampled tokens out.

The runner owns the KV cache (one preallocated tensor), the model and the sampler. It
flattens every scheduled token of every sequence into one batch without padding.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from paged_llm.config import EngineConfig
from paged_llm.engine.batch import HostBatch, attention_metadata, build_host_batch, to_device
from paged_llm.engine.cuda_graphs import DecodeGraphs
from paged_llm.engine.sampling_metadata import build_sampling_metadata
from paged_llm.engine.scheduler import ScheduledBatch
from paged_llm.engine.sequence import RawLogprobs, Sequence
from paged_llm.layers.attention import Attention, TritonAttentionBackend, get_attention_backend
from paged_llm.layers.linear import prepack_for_cpu
from paged_llm.layers.sampler import LogprobsTensors, Sampler, compute_logprobs
from paged_llm.loader import load_weights
from paged_llm.models import get_model_class

logger = logging.getLogger(__name__)

# Share of the RAM available at start-up that the KV cache may take on CPU when no
# kv_cache_memory_bytes is given.
CPU_KV_CACHE_RAM_FRACTION = 0.25


def load_model(config: EngineConfig) -> nn.Module:
    """Build the model without initializing weights, then fill it from the checkpoint."""
    model_class = get_model_class(config.hf_config)
    with torch.device("meta"):
        model = model_class(config.hf_config, config.max_model_len, config.device)
    model = model.to(dtype=config.dtype).to_empty(device=config.device)
    model.tie_weights()
    load_weights(model, config.model_dir)
    if config.device.type == "cpu" and config.dtype in (torch.float32, torch.bfloat16):
        prepack_for_cpu(model)
    return model.eval()


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_PROMPT_LOGPROBS_SLICE = 512


@dataclass(slots=True)
class StepOutput:
    # One token per sampling sequence, in batch order.
    sampled_token_ids: list[int]
    # Per sampling sequence: its logprobs, or None where it asked for none.
    logprobs: list[RawLogprobs | None] | None
    # seq_id -> logprobs of the prompt positions scored this step, in order.
    prompt_logprobs: dict[int, list[RawLogprobs]]


def _logprob_rows(tensors: LogprobsTensors, seqs: list[Sequence], field: str) -> list[RawLogprobs]:
    """Per row: the scored token plus as many top tokens as the row's sequence asked for."""
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    rows = []
    for seq, ids, lps, rank in zip(seqs, token_ids, logprobs, ranks, strict=True):
        wanted = getattr(seq.sampling_params, field) or 0
        width = len(ids) if wanted == -1 else 1 + wanted
        rows.append((ids[:width], lps[:width], rank))
    return rows


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.device = config.device
        self.block_size = config.block_size
        self.model = load_model(config)
        self.attention_backend = get_attention_backend(config.attention_backend)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.attention_backend
        self.attention_backend.setup(
            self.kv_bytes_per_token // len(self.attention_layers),
            any(layer.sliding_window is not None for layer in self.attention_layers),
        )
        self.sampler = Sampler()
        self.kv_cache = torch.empty(0)
        self.num_blocks = self._allocate_kv_cache()
        self.decode_graphs: DecodeGraphs | None = None
        if self._use_cuda_graphs():
            with torch.inference_mode():
                self.decode_graphs = DecodeGraphs(
                    self.model,
                    config.max_num_seqs,
                    config.max_model_len,
                    self.block_size,
                    self.device,
                )
            logger.info("Captured CUDA graphs for decode batches of %s.", self.decode_graphs.sizes)

    def _use_cuda_graphs(self) -> bool:
        # Only the Triton backend reads nothing but device tensors, as replay requires.
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and isinstance(self.attention_backend, TritonAttentionBackend)
        )

    # ----- KV cache -------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv heads x head dim x bytes per element."""
        first = self.attention_layers[0]
        element_size = torch.empty(0, dtype=self.config.dtype).element_size()
        return 2 * len(self.attention_layers) * first.num_kv_heads * first.head_dim * element_size

    def _kv_cache_budget_bytes(self) -> int:
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            return self._profile_gpu_budget_bytes()
        # A CPU has no profiling pass to learn from; take a fixed share of free RAM, and
        # no more than max_num_seqs full-length sequences could ever use.
        most_useful = config.max_num_seqs * config.max_model_len * self.kv_bytes_per_token
        return min(int(_available_ram_bytes() * CPU_KV_CACHE_RAM_FRACTION), most_useful)

    def _profile_gpu_budget_bytes(self) -> int:
        """What is left of ``gpu_memory_utilization`` of the device after the weights and
        the activations of one full step (measured by running one)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_run(self.config.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # Memory other processes and the CUDA context hold is unavailable to us as well.
        free, _ = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.gpu_memory_utilization) - peak - used_by_others

    def _allocate_kv_cache(self) -> int:
        config = self.config
        budget = self._kv_cache_budget_bytes()
        bytes_per_block = self.kv_bytes_per_token * self.block_size
        num_blocks = max(budget // bytes_per_block, 0)
        blocks_per_seq = -(-config.max_model_len // self.block_size)
        if num_blocks < blocks_per_seq:
            fits = num_blocks * self.block_size
            knob = (
                "kv_cache_memory_bytes"
                if config.kv_cache_memory_bytes is not None or self.device.type == "cpu"
                else "gpu_memory_utilization (or kv_cache_memory_bytes)"
            )
            raise ValueError(
                f"The KV cache cannot hold one sequence of max_model_len={config.max_model_len} "
                f"tokens: that needs {blocks_per_seq * bytes_per_block / 2**30:.3f} GiB, and "
                f"{max(budget, 0) / 2**30:.3f} GiB are available for the cache "
                f"({fits} tokens). Raise {knob}, or lower max_model_len to at most {fits}."
            )
        first = self.attention_layers[0]
        shape = self.attention_backend.kv_cache_shape(
            num_blocks, self.block_size, first.num_kv_heads, first.head_dim
        )
        # NOTE: zero-filled, not empty: attention reads whole blocks and masks the unused
        # tail, and a NaN bit pattern there would survive a zero weight.
        self.kv_cache = torch.zeros(
            (len(self.attention_layers), 2, *shape), dtype=config.dtype, device=self.device
        )
        for i, layer in enumerate(self.attention_layers):
            layer.key_cache, layer.value_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); maximum concurrency at "
            "max_model_len=%d: %.2fx.",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
            config.max_model_len,
            num_blocks / blocks_per_seq,
        )
        return num_blocks

    def _dummy_run(self, num_tokens: int) -> None:
        """A forward pass over ``num_tokens`` fresh prompt tokens, with a throwaway cache."""
        seq_len = min(num_tokens, self.config.max_model_len)
        seq_lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            seq_lens.append(num_tokens % seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        first = self.attention_layers[0]
        shape = self.attention_backend.kv_cache_shape(
            blocks_per_seq * len(seq_lens), self.block_size, first.num_kv_heads, first.head_dim
        )
        scratch = torch.zeros((2, *shape), dtype=self.config.dtype, device=self.device)
        for layer in self.attention_layers:
            layer.key_cache, layer.value_cache = scratch[0], scratch[1]
        block_tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(seq_lens))
        ]
        batch = build_host_batch(
            token_ids=[[0] * n for n in seq_lens],
            num_computed=[0] * len(seq_lens),
            num_scheduled=seq_lens,
            block_tables=block_tables,
            samples=[True] * len(seq_lens),
            block_size=self.block_size,
        )
        with torch.inference_mode():
            hidden = self._forward(batch)
            self.model.compute_logits(hidden[to_device(batch.logits_indices, self.device)])

    # ----- one step -------------------------------------------------------------------

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        """Hidden states of every token of the batch (a CUDA graph replay when one fits)."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        device = self.device
        metadata = attention_metadata(batch, self.block_size, self.attention_backend, device)
        return self.model(
            to_device(batch.input_ids, device), to_device(batch.positions, device), metadata
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run the step: one token (and its logprobs, if asked) per sampling sequence, and
        the prompt logprobs the step's prompt chunks owe."""
        host = build_host_batch(
            token_ids=[seq.token_ids for seq in batch.seqs],
            num_computed=[seq.num_computed_tokens for seq in batch.seqs],
            num_scheduled=batch.num_scheduled_tokens,
            block_tables=[seq.block_table for seq in batch.seqs],
            samples=batch.samples,
            block_size=self.block_size,
        )
        hidden = self._forward(host)
        output = StepOutput(
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs=self._prompt_logprobs(batch, host.query_start_loc.tolist(), hidden),
        )
        sampling_seqs = batch.sampling_seqs
        if not sampling_seqs:
            return output
        logits_indices = to_device(host.logits_indices, self.device)
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        metadata = build_sampling_metadata(
            sampling_seqs, logits.shape[-1], self.eos_token_ids, self.device
        )
        sampled = self.sampler(logits, metadata)
        output.sampled_token_ids = sampled.token_ids.tolist()
        if sampled.logprobs is not None:
            output.logprobs = [
                None if seq.sampling_params.logprobs is None else row
                for seq, row in zip(
                    sampling_seqs,
                    _logprob_rows(sampled.logprobs, sampling_seqs, "logprobs"),
                    strict=True,
                )
            ]
        return output

    def _prompt_logprobs(
        self, batch: ScheduledBatch, query_start_loc: list[int], hidden: torch.Tensor
    ) -> dict[int, list[RawLogprobs]]:
        """Score the prompt tokens that this step's chunks predict and that are not scored
        yet: the hidden state at position p gives the logprob of prompt token p + 1."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Sequence, int]] = []  # (sequence, number of its rows)
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens, strict=True)):
            if seq.index != 0 or not seq.request.needs_prompt_logprobs:
                continue
            start = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs))
            end = min(seq.num_computed_tokens + count, seq.num_prompt_tokens - 1)
            if start >= end:
                continue
            offset = query_start_loc[i] - seq.num_computed_tokens
            rows.extend(range(offset + start, offset + end))
            targets.extend(seq.token_ids[start + 1 : end + 1])
            owners.append((seq, end - start))
        if not rows:
            return {}
        wanted = [seq.sampling_params.prompt_logprobs for seq, _ in owners]
        num_top = -1 if -1 in wanted else max(wanted)
        row_index = torch.tensor(rows, device=self.device)
        target_ids = torch.tensor(targets, device=self.device)
        scored: list[LogprobsTensors] = []
        # Slices bound the [rows, vocab] logits a long prompt would otherwise need at once.
        for start in range(0, len(rows), _PROMPT_LOGPROBS_SLICE):
            part = slice(start, start + _PROMPT_LOGPROBS_SLICE)
            logits = self.model.compute_logits(hidden[row_index[part]]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            k = logprobs.shape[-1] if num_top == -1 else num_top
            scored.append(compute_logprobs(logprobs, target_ids[part], k))
        merged = LogprobsTensors(
            token_ids=torch.cat([s.token_ids for s in scored]),
            logprobs=torch.cat([s.logprobs for s in scored]),
            ranks=torch.cat([s.ranks for s in scored]),
        )
        row_seqs = [seq for seq, count in owners for _ in range(count)]
        all_rows = _logprob_rows(merged, row_seqs, "prompt_logprobs")
        result: dict[int, list[RawLogprobs]] = {}
        position = 0
        for seq, count in owners:
            result[seq.seq_id] = all_rows[position : position + count]
            position += count
        return result

    def shutdown(self) -> None:
        """Drop the KV cache and the weights so their memory can be reclaimed."""
        for layer in self.attention_layers:
            layer.key_cache = layer.value_cache = torch.empty(0)
        self.attention_layers.clear()
        self.decode_graphs = None
        self.kv_cache = torch.empty(0)
        self.model = nn.Module()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
