"""Runs one scheduled step through the model: batch tensors in, sampled tokens out.

The runner owns the KV cache (one preallocated tensor), the model and the sampler. It
flattens every scheduled token of every sequence into one batch without padding.

With tensor parallelism every rank has a runner over its shard of the weights and of the
KV cache. Rank 0 plans each step (`StepPlan`), hands it to the other ranks, and samples;
the others `follow` the plan, taking part in the collectives inside the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from paged_llm.config import EngineConfig
from paged_llm.distributed.group import TensorParallelGroup
from paged_llm.engine.batch import HostBatch, attention_metadata, build_host_batch, to_device
from paged_llm.engine.cuda_graphs import DecodeGraphs
from paged_llm.engine.lora_manager import LoRAModelSlots, LoRASlotTable, LoRAStepPlan
from paged_llm.engine.model_loading import load_model
from paged_llm.engine.persistent_batch import LogitsProcessors
from paged_llm.engine.pooler import Pooler
from paged_llm.engine.sampling_metadata import SamplingRow, build_sampling_metadata, sampling_rows
from paged_llm.engine.scheduler import ScheduledBatch
from paged_llm.engine.sequence import RawLogprobs, Sequence
from paged_llm.engine.speculation import num_accepted
from paged_llm.layers.attention import Attention, KVCacheLayout, get_attention_backend
from paged_llm.layers.linear import return_freed_heap_memory
from paged_llm.layers.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_logprobs
from paged_llm.platforms import DecodeGraphMode
from paged_llm.structured_outputs.xgrammar_backend import apply_grammar_bitmask, grammar_bitmask

logger = logging.getLogger(__name__)


_PROMPT_LOGPROBS_SLICE = 512


@dataclass(slots=True)
class StepPlan:
    """What every rank needs to run one step: the flat batch, and the groups of rows whose
    logits are computed, in order (the sampling rows, then prompt-logprob rows in slices
    that bound the ``[rows, vocab]`` logits of a long prompt)."""

    host: HostBatch
    logits_rows: list[np.ndarray]
    # (source, destination) cache blocks to copy before the forward writes to the cache.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The step's LoRA adapters; None: the base model only.
    lora: LoRAStepPlan | None = None


@dataclass(slots=True)
class _PromptScoring:
    """Rank 0's record of the prompt tokens a step scores."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[Sequence, int]]  # (sequence, number of its rows)


@dataclass(slots=True)
class StepOutput:
    # Per sampling sequence, in batch order: the tokens it emits, one unless it speculated
    # (its accepted draft tokens, then the token drawn after them).
    sampled_token_ids: list[list[int]]
    # Per sampling sequence: the logprobs of each emitted token, or None where it asked for
    # none.
    logprobs: list[list[RawLogprobs] | None] | None
    # seq_id -> logprobs of the prompt positions scored this step, in order.
    prompt_logprobs: dict[int, list[RawLogprobs]]
    # Sampling rows whose masks left no token: their tokens and logprobs mean nothing.
    no_token_rows: list[int] = field(default_factory=list)
    # seq_id -> the pooler's output, for each pooling sequence whose prompt is computed.
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


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
    """One rank's model, KV cache and (on rank 0) sampler.

    ``announce`` is called with each step's plan before rank 0 runs it: the executor's
    way to hand it to the other ranks.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        tp: TensorParallelGroup | None = None,
        announce: Callable[[StepPlan], None] | None = None,
    ) -> None:
        self.config = config
        self.platform = config.platform
        self.device = config.device
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.tp = tp or TensorParallelGroup()
        self.announce = announce
        self.sampler = Sampler()
        self.kv_cache = torch.empty(0)
        self.decode_graphs: DecodeGraphs | None = None
        # What `sleep` released and `wake_up` has not yet taken back ("weights",
        # "kv_cache"), and whether the weights were dropped (level 2) or only moved.
        self.asleep: set[str] = set()
        self.weights_dropped = False
        self._start_up()
        # Custom logits processors, on rank 0 only: the other ranks never sample.
        self.logits_processors = (
            LogitsProcessors(config, self.num_blocks)
            if config.logits_processors and self.tp.is_first
            else None
        )

    def _start_up(self) -> None:
        """The one start-up order, on every platform and rank: load the weights, check the
        memory there is for the KV cache, profile one full step, size and allocate the KV
        cache from what is left, then capture graphs.

        Steps before the last run eagerly: graphs need the cache they read from. Nothing
        sized by max_model_len exists before the check: the model's rotary table is
        computed by its first forward (the profile step on GPU).
        """
        self.attention_backend = get_attention_backend(self.config.attention_backend)
        self._build_model()
        first = self.attention_layers[0]
        self.kv_cache_layout = KVCacheLayout(
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            compute_dtype=self.config.dtype,
            cache_dtype=self.config.kv_cache_dtype,
            has_sliding_window=any(
                layer.sliding_window is not None for layer in self.attention_layers
            ),
        )
        self.attention_backend.setup(self.kv_cache_layout, self.config.batch_invariant)
        self._check_kv_cache_memory()
        config = self.config
        budget = self.platform.kv_cache_budget_bytes(
            config.kv_cache_memory_bytes,
            config.gpu_memory_utilization,
            # NOTE: whole blocks: a max_model_len that is no multiple of the block size
            # still needs its last block.
            config.scheduler.max_num_seqs
            * self._blocks_per_seq
            * self.block_size
            * self.kv_bytes_per_token,
            self._profile_step,
        )
        # Every rank holds the same blocks, so the smallest budget decides.
        self.num_blocks = self._cache_blocks(self.tp.min_over_ranks(budget))
        self._allocate_kv_cache()
        self.decode_graphs = self._capture_decode_graphs()

    def _build_model(self) -> None:
        """Load this rank's weights, and wire what reads the model: the adapter slots (they
        take their memory before the cache is sized), the attention layers' backend and
        the pooler."""
        self.model = load_model(self.config, self.tp)
        lora = self.config.lora
        self.lora_slots = None if lora is None else LoRAModelSlots(self.model, self.config, lora)
        self.lora_slot_table = None if lora is None else LoRASlotTable(lora.max_loras)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.attention_backend
        pooler = self.config.pooler
        self.pooler = None if pooler is None or not self.tp.is_first else Pooler(self.model, pooler)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        mode = self.platform.decode_graph_mode
        if (
            mode is DecodeGraphMode.NONE
            or self.config.enforce_eager
            or not self.attention_backend.supports_decode_graphs
            # NOTE: collectives inside captured graphs are untested; TP decodes run eagerly.
            or self.tp.size > 1
        ):
            return None
        with torch.inference_mode():
            graphs = DecodeGraphs(
                self.model,
                self.config.scheduler.max_num_seqs,
                self.config.max_model_len,
                self.block_size,
                self.device,
                capture=mode is DecodeGraphMode.CAPTURE,
            )
        logger.info("Decode graphs (%s) for batches of %s.", mode.value, graphs.sizes)
        return graphs

    # ----- KV cache -------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes of one token over every layer of this rank."""
        return len(self.attention_layers) * self.kv_cache_layout.stored_bytes_per_token

    @property
    def _blocks_per_seq(self) -> int:
        """Cache blocks of one sequence of max_model_len tokens."""
        return -(-self.config.max_model_len // self.block_size)

    def _check_kv_cache_memory(self) -> None:
        """Refuse a kv_cache_memory_bytes over the memory there is, and a max_model_len
        whose sequence even all of it could not hold, before anything sized by them exists
        (an allocator's error or the OOM killer would say neither)."""
        # Every rank must decide alike, so the smallest figure decides.
        available = self.tp.min_over_ranks(self.platform.available_kv_cache_bytes(self.tp.size))
        requested = self.config.kv_cache_memory_bytes
        if requested is not None and requested > available:
            per_rank = " per rank" if self.tp.size > 1 else ""
            raise ValueError(
                f"kv_cache_memory_bytes={requested} ({requested / 2**30:.3f} GiB{per_rank}) is "
                f"more than the {available / 2**30:.3f} GiB of "
                f"{self.platform.available_memory_name}{per_rank} after loading the weights. "
                f"Lower kv_cache_memory_bytes to at most {available}, or leave it unset to let "
                f"the {self.platform.name} platform size the cache."
            )
        self._cache_blocks(available if requested is None else requested)

    def _cache_blocks(self, budget: int) -> int:
        """The cache blocks ``budget`` bytes make; a ValueError if they cannot hold one
        sequence of max_model_len tokens."""
        config = self.config
        bytes_per_block = self.kv_bytes_per_token * self.block_size
        num_blocks = max(budget // bytes_per_block, 0)
        if num_blocks < self._blocks_per_seq:
            fits = num_blocks * self.block_size
            knob = (
                "kv_cache_memory_bytes"
                if config.kv_cache_memory_bytes is not None
                else self.platform.kv_budget_setting
            )
            raise ValueError(
                f"The KV cache cannot hold one sequence of max_model_len={config.max_model_len} "
                f"tokens: that needs {self._blocks_per_seq * bytes_per_block / 2**30:.3f} GiB, "
                f"and {max(budget, 0) / 2**30:.3f} GiB are available for the cache "
                f"({fits} tokens). Raise {knob}, or lower max_model_len to at most {fits}."
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        config = self.config
        num_blocks = self.num_blocks
        shape = self._kv_cache_shape(num_blocks)
        # NOTE: zero-filled, not empty: attention reads whole blocks and masks the unused
        # tail, and a NaN bit pattern there would survive a zero weight.
        self.kv_cache = torch.zeros(
            (len(self.attention_layers), 2, *shape), dtype=config.kv_cache_dtype, device=self.device
        )
        self._link_kv_cache()
        if self.tp.is_first:
            logger.info(
                "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB per rank, %s); maximum "
                "concurrency at max_model_len=%d: %.2fx.",
                num_blocks,
                self.block_size,
                num_blocks * self.block_size,
                self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
                str(config.kv_cache_dtype).removeprefix("torch."),
                config.max_model_len,
                num_blocks / self._blocks_per_seq,
            )

    def _link_kv_cache(self) -> None:
        """Give every attention layer its view of the cache (an empty one while asleep)."""
        for i, layer in enumerate(self.attention_layers):
            if self.kv_cache.numel() == 0:
                layer.key_cache = layer.value_cache = self.kv_cache
            else:
                layer.key_cache, layer.value_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Tokens the KV cache holds: its blocks times their size."""
        return self.num_blocks * self.block_size

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        layout = self.kv_cache_layout
        return self.attention_backend.kv_cache_shape(
            num_blocks, self.block_size, layout.num_kv_heads, layout.head_dim
        )

    def _profile_step(self) -> None:
        """The largest step the scheduler can send: ``max_num_batched_tokens`` fresh prompt
        tokens, sampled in as many sequences as the budget makes, with a throwaway cache."""
        num_tokens = self.config.scheduler.max_num_batched_tokens
        seq_len = min(num_tokens, self.config.max_model_len)
        seq_lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            seq_lens.append(num_tokens % seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = torch.zeros(
            (2, *self._kv_cache_shape(blocks_per_seq * len(seq_lens))),
            dtype=self.config.kv_cache_dtype,
            device=self.device,
        )
        for layer in self.attention_layers:
            layer.key_cache, layer.value_cache = scratch[0], scratch[1]
        host = build_host_batch(
            token_ids=[[0] * n for n in seq_lens],
            num_computed=[0] * len(seq_lens),
            num_scheduled=seq_lens,
            block_tables=[
                list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                for i in range(len(seq_lens))
            ],
            samples=[self.model.lm_head is not None] * len(seq_lens),
            block_size=self.block_size,
        )
        with torch.inference_mode():
            for _ in self._run(StepPlan(host, [host.logits_indices])):
                pass

    # ----- one step -------------------------------------------------------------------

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        """Hidden states of every token of the batch (a CUDA graph replay when one fits)."""
        # NOTE: graphs are captured without adapters, so a step with adapters runs eagerly.
        lora_batch = None if self.lora_slots is None else self.lora_slots.state.batch
        if (
            self.decode_graphs is not None
            and lora_batch is None
            and self.decode_graphs.can_run(batch)
        ):
            return self.decode_graphs.run(batch)
        platform = self.platform
        metadata = attention_metadata(batch, self.block_size, self.attention_backend, platform)
        hidden: torch.Tensor = self.model(
            to_device(batch.input_ids, platform), to_device(batch.positions, platform), metadata
        )
        return hidden

    def _run(self, plan: StepPlan) -> Iterator[torch.Tensor | None]:
        """The forward pass's hidden states, then the logits of each group of rows in turn
        (None on ranks other than 0, and for an empty group). Every rank runs the same
        sequence of collectives, so each must consume the whole iterator."""
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        if self.lora_slots is not None:
            self.lora_slots.begin_step(plan.lora)
        hidden = self._forward(plan.host)
        yield hidden
        for rows in plan.logits_rows:
            if len(rows) == 0:
                yield None
                continue
            yield self.model.compute_logits(hidden[to_device(rows, self.platform)])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, keys and values of every layer, in one gather and scatter."""
        source, destination = (
            to_device(np.asarray(blocks, dtype=np.int64), self.platform)
            for blocks in zip(*copies, strict=True)
        )
        # kv_cache is [layers, 2 (key, value), *the backend's cache shape].
        axis = 2 + self.attention_backend.kv_cache_block_axis
        # NOTE: as bytes, whatever the cache dtype: index_copy_ is not implemented for
        # float8 on CPU.
        cache = self.kv_cache.view(torch.uint8)
        cache.index_copy_(axis, destination, cache.index_select(axis, source))

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A rank other than 0: run rank 0's step over this rank's shard."""
        for _ in self._run(plan):
            pass

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
            drafts=[seq.draft for seq in batch.seqs],
        )
        scoring = self._plan_prompt_scoring(batch, host.query_start_loc.tolist())
        plan = StepPlan(
            host,
            [
                host.logits_indices,
                *(
                    np.asarray(scoring.rows[start : start + _PROMPT_LOGPROBS_SLICE])
                    for start in range(0, len(scoring.rows), _PROMPT_LOGPROBS_SLICE)
                ),
            ],
            batch.block_copies,
            None if self.lora_slot_table is None else self.lora_slot_table.plan(batch),
        )
        if self.announce is not None:
            self.announce(plan)
        logits_groups = self._run(plan)
        hidden = next(logits_groups)
        assert hidden is not None
        pooled = (
            {}
            if not batch.pooling_seqs or self.pooler is None
            else self.pooler.pool(hidden, batch, host.query_start_loc)
        )
        sampling_logits = next(logits_groups)
        output = StepOutput(
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs=self._score_prompts(scoring, logits_groups),
            pooled=pooled,
        )
        sampling_seqs = batch.sampling_seqs
        processing = (
            None
            if self.logits_processors is None
            else self.logits_processors.prepare(sampling_seqs)
        )
        if sampling_logits is None:
            return output
        logits = sampling_logits.float()
        rows = sampling_rows(sampling_seqs)
        # NOTE: a sequence with a grammar never speculates: its row is its only one.
        bitmask = grammar_bitmask([row.seq.grammar for row in rows])
        if bitmask is not None:
            # NOTE: before the sampler, as vLLM's runner does: its logprobs are then those
            # of the distribution the grammar leaves. A -inf logit stays -inf under the
            # sampler's bias, bans and penalties, so the order draws the same tokens as
            # masking after them would.
            apply_grammar_bitmask(
                logits,
                bitmask,
                [index for index, row in enumerate(rows) if row.seq.grammar is not None],
            )
        metadata = build_sampling_metadata(
            rows, logits.shape[-1], self.eos_token_ids, self.device, bitmask
        )
        if processing is not None:
            processing.add_to(metadata)
        sampled = self.sampler(logits, metadata)
        self._verify(output, sampled, sampling_seqs, rows)
        return output

    @staticmethod
    def _verify(
        output: StepOutput,
        sampled: SamplerOutput,
        sampling_seqs: list[Sequence],
        rows: list[SamplingRow],
    ) -> None:
        """Per sampling sequence, the tokens it emits: the token drawn from its row, or
        after a draft the accepted draft tokens and the token drawn after them (see
        engine/speculation.py), with their logprobs; a sequence fails (``no_token_rows``)
        where a row it emits from had no token to draw."""
        drawn = sampled.token_ids.tolist()
        no_token = (
            set()
            if sampled.no_token is None
            else set(sampled.no_token.nonzero().flatten().tolist())
        )
        logprob_rows = (
            None
            if sampled.logprobs is None
            else _logprob_rows(sampled.logprobs, [row.seq for row in rows], "logprobs")
        )
        output.logprobs = None if logprob_rows is None else []
        start = 0
        for index, seq in enumerate(sampling_seqs):
            end = start + 1 + len(seq.draft)
            emitted = 1 + num_accepted(drawn[start:end], seq.draft)
            output.sampled_token_ids.append(drawn[start : start + emitted])
            if not no_token.isdisjoint(range(start, start + emitted)):
                output.no_token_rows.append(index)
            if output.logprobs is not None:
                assert logprob_rows is not None
                output.logprobs.append(
                    None
                    if seq.sampling_params.logprobs is None
                    else logprob_rows[start : start + emitted]
                )
            start = end

    def _plan_prompt_scoring(
        self, batch: ScheduledBatch, query_start_loc: list[int]
    ) -> _PromptScoring:
        """The prompt tokens that this step's chunks predict and that are not scored yet:
        the hidden state at position p gives the logprob of prompt token p + 1."""
        scoring = _PromptScoring(rows=[], targets=[], owners=[])
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens, strict=True)):
            if seq.index != 0 or not seq.request.needs_prompt_logprobs:
                continue
            start = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs))
            end = min(seq.num_computed_tokens + count, seq.num_prompt_tokens - 1)
            if start >= end:
                continue
            offset = query_start_loc[i] - seq.num_computed_tokens
            scoring.rows.extend(range(offset + start, offset + end))
            scoring.targets.extend(seq.token_ids[start + 1 : end + 1])
            scoring.owners.append((seq, end - start))
        return scoring

    def _score_prompts(
        self, scoring: _PromptScoring, logits_slices: Iterator[torch.Tensor | None]
    ) -> dict[int, list[RawLogprobs]]:
        """Logprobs of the planned prompt tokens, from the logits of their row slices."""
        if not scoring.rows:
            return {}
        wanted = [seq.sampling_params.prompt_logprobs or 0 for seq, _ in scoring.owners]
        num_top = -1 if -1 in wanted else max(wanted)
        target_ids = torch.tensor(scoring.targets, device=self.device)
        scored: list[LogprobsTensors] = []
        for start, logits in zip(
            range(0, len(scoring.rows), _PROMPT_LOGPROBS_SLICE), logits_slices, strict=True
        ):
            assert logits is not None
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            k = logprobs.shape[-1] if num_top == -1 else num_top
            part = slice(start, start + _PROMPT_LOGPROBS_SLICE)
            scored.append(compute_logprobs(logprobs, target_ids[part], k))
        merged = LogprobsTensors(
            token_ids=torch.cat([s.token_ids for s in scored]),
            logprobs=torch.cat([s.logprobs for s in scored]),
            ranks=torch.cat([s.ranks for s in scored]),
        )
        row_seqs = [seq for seq, count in scoring.owners for _ in range(count)]
        all_rows = _logprob_rows(merged, row_seqs, "prompt_logprobs")
        result: dict[int, list[RawLogprobs]] = {}
        position = 0
        for seq, count in scoring.owners:
            result[seq.seq_id] = all_rows[position : position + count]
            position += count
        return result

    # ----- sleep mode ------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Give the KV cache's memory back (its contents are lost). Level 1 keeps the
        weights (on CUDA, moved to host memory); level 2 drops them."""
        self.decode_graphs = None
        self.kv_cache = torch.empty(0)
        self._link_kv_cache()
        self.asleep.add("kv_cache")
        if level == 2 and not self.weights_dropped:
            self._drop_model()
            self.weights_dropped = True
            self.asleep.add("weights")
        elif level == 1 and self.device.type != "cpu" and "weights" not in self.asleep:
            self._move_model(torch.device("cpu"))
            self.asleep.add("weights")
        self.platform.empty_cache()
        return_freed_heap_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` released, or only the ``tags`` given ("weights",
        "kv_cache"). Dropped weights are read again from the model's files."""
        tags_set = {"weights", "kv_cache"} if tags is None else set(tags)
        if "weights" in tags_set and "weights" in self.asleep:
            if self.weights_dropped:
                self._build_model()
                self.weights_dropped = False
            else:
                self._move_model(self.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags_set and "kv_cache" in self.asleep:
            self._allocate_kv_cache()
            self.asleep.discard("kv_cache")
        self._link_kv_cache()
        if not self.asleep:
            self.decode_graphs = self._capture_decode_graphs()

    def _move_model(self, device: torch.device) -> None:
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            tensor.data = tensor.data.to(device)

    def _drop_model(self) -> None:
        self.attention_layers.clear()
        self.pooler = self.lora_slots = None
        del self.model

    def shutdown(self) -> None:
        """Drop the KV cache and the weights so their memory can be reclaimed."""
        self.sleep(level=2)
