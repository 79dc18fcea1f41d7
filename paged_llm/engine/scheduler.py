"""Continuous batching: which sequences run each step, and how many tokens each.

The scheduler speaks only in token counts. Every step it first gives each running
sequence the tokens it still needs (one for a decode, a chunk for an unfinished
prefill), then admits waiting sequences first-come first-served while the token
budget and ``max_num_seqs`` allow, chunking a prompt that does not fit (or, without
chunked prefill, leaving it for a later step). A prompt whose next uncached block another
sequence computes in the same step waits for the next one, to find that block cached. When a running
sequence needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it waits again at the front of the queue,
keeping its generated tokens, to be recomputed later.

With LoRA adapters, the sequences running at once use at most ``max_loras`` distinct
adapters (the base model counts as none). A waiting request whose adapter would be one too
many is held back, in its place in the queue, while requests of adapters already running
are admitted behind it; when the last sequence of an adapter finishes, its place goes to the
adapter of the longest-waiting request held back, so every adapter runs in turn.

A request whose next tokens an owner outside the scheduler chooses
(``Request.tokens_chosen_externally``: the beam search of engine/beam_search.py) runs like
any other, except at the end of a step: a sequence of it that was scored gets no token
appended and awaits an external step (``Sequence.awaits_external_step``). It has nothing to
compute until its owner appends its next tokens and calls `resume`: meanwhile it is skipped,
and if its blocks are needed it gives them up and is paused (``paused``: it keeps its place
in ``max_num_seqs`` and its scores) rather than queued to be recomputed. The owner starts
new sequences from it with `fork`, on its blocks, into the places it reserved
(``Sequence.num_reserved_seqs``), and ends the ones it is done with through `release`.

A pooling request's sequence (``Request.pooling_params``) is prefill only: it is chunked
like any prompt, never samples (``ScheduledBatch.pooling_seqs`` instead of
``sampling_seqs``), and `update` finishes it, freeing its blocks, in the step that computes
its last prompt token. One pooled over every token (``Request.pools_every_token``) is
admitted without cached blocks, since the cache holds no hidden states.

With speculative decoding (``speculator``), once the step's sequences and admissions are
planned, a decoding sequence that speculates gets its draft (engine/speculation.py) from
the budget and free blocks left: ``Sequence.draft``, computed after its last token and
verified by the runner. `update` appends what the verification accepted, one token at a
time with the stop checks, and only then offers the sequence's full blocks to the prefix
cache, so a draft's tokens never reach it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from paged_llm.config import SchedulerConfig
from paged_llm.engine.block_manager import BlockHash, BlockManager
from paged_llm.engine.sequence import FinishReason, Request, Sequence, SequenceStatus
from paged_llm.engine.speculation import SequenceDrafter, Speculator

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: ``num_scheduled_tokens[i]`` tokens of ``seqs[i]``, starting at its
    ``num_computed_tokens``. ``samples[i]``: the step reaches the sequence's last token,
    so a new token is drawn for it; never for a pooling sequence, which is in ``pooling_seqs``
    instead (every chunk of its prompt is pooled)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    # The sequences with samples[i] set, in batch order: one sampled token each.
    sampling_seqs: list[Sequence] = field(default_factory=list)
    # The sequences of pooling requests, in batch order: their chunks' hidden states are
    # pooled, and the step that computes a prompt's last token finishes it.
    pooling_seqs: list[Sequence] = field(default_factory=list)
    # (source, destination) cache blocks to copy before the forward (`BlockManager.fork`).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        sample = seq.num_computed_tokens + num_tokens == seq.num_tokens
        if seq.request.pooling_params is not None:
            self.pooling_seqs.append(seq)
            sample = False
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)
        self.samples.append(sample)
        if sample:
            self.sampling_seqs.append(seq)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def drop_requests(self, request_ids: set[str]) -> list[int]:
        """Take the sequences of these requests out of the step (their requests failed);
        return the rows of ``sampling_seqs`` that stay, in order."""
        kept = [i for i, seq in enumerate(self.seqs) if seq.request_id not in request_ids]
        kept_rows = [
            row for row, seq in enumerate(self.sampling_seqs) if seq.request_id not in request_ids
        ]
        self.seqs = [self.seqs[i] for i in kept]
        self.num_scheduled_tokens = [self.num_scheduled_tokens[i] for i in kept]
        self.samples = [self.samples[i] for i in kept]
        self.sampling_seqs = [self.sampling_seqs[row] for row in kept_rows]
        self.pooling_seqs = [s for s in self.pooling_seqs if s.request_id not in request_ids]
        return kept_rows


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: frozenset[int],
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        # Speculative decoding's drafts; None: off.
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        # In admission order: the last one is the most recently admitted.
        self.running: list[Sequence] = []
        # Sequences awaiting an external step that gave up their blocks, until `resume`.
        self.paused: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule()
        while not batch.seqs and self.running:
            # NOTE: only sequences awaiting an external step run (they have nothing to
            # compute), and they hold the blocks that one in the queue needs, typically the
            # sibling their owner waits for: pause them, most recent first, until the queue
            # moves. They keep their scores, so each external step comes closer.
            victim = self.running.pop()
            assert victim.awaits_external_step, victim
            self._preempt(victim)
            batch = self._schedule()
        batch.block_copies = self.block_manager.take_pending_copies()
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaits_external_step:
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.add(seq, num_new)
                budget -= num_new
                i += 1

        num_slots_taken = sum(_num_slots_held(seq) for seq in (*self.running, *self.paused))
        # Full blocks this step computes, by hash, and the prompts that wait a step because
        # their next uncached block is one of them: next step they find it cached instead of
        # computing it again (the choices of a multiple-choice question, a shared system
        # prompt, the rest of a long prompt being chunked). Their order in the queue stays.
        in_flight: set[BlockHash] = set()
        if self.waiting and self.block_manager.enable_prefix_caching:
            # Only admissions read it: a decode step with nobody waiting skips the walk.
            for seq, num_new in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
                in_flight.update(self._completed_block_hashes(seq, num_new))
        # Sequences passed over this step (waiting for a block in flight, or for a place
        # for their adapter), put back in their order.
        held_back: list[Sequence] = []
        loras = self._running_loras()
        # NOTE: no admissions in a step that preempted: blocks are short, and a newcomer
        # would only be preempted in turn.
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            num_slots = _num_slots_held(seq)
            if num_slots_taken + num_slots > self.config.max_num_seqs:
                break
            lora_int_id = seq.request.lora_int_id
            if lora_int_id and lora_int_id not in loras and len(loras) == self.config.max_loras:
                # Bounded, so that a queue of thousands of such requests is not scanned
                # whole in one step.
                if len(held_back) == self.config.max_num_seqs:
                    break
                held_back.append(self.waiting.popleft())
                continue
            # NOTE: cached blocks have no logits and no hidden states, so a prompt still
            # owing prompt logprobs is computed from the first position whose logits it
            # needs, and one pooled over every token from position 0.
            needs_logits = seq.index == 0 and seq.request.needs_prompt_logprobs
            cached_prefix = self.block_manager.find_cached_prefix(
                seq,
                0
                if seq.request.pools_every_token
                else len(seq.request.prompt_logprobs)
                if needs_logits
                else None,
            )
            num_hits = len(cached_prefix)
            if num_hits < len(seq.block_hashes) and seq.block_hashes[num_hits] in in_flight:
                if len(held_back) == self.config.max_num_seqs:
                    break
                held_back.append(self.waiting.popleft())
                continue
            num_cached = num_hits * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if num_new < seq.num_tokens - num_cached and not self.config.chunked_prefill:
                break
            if not self.block_manager.allocate_slots(seq, num_new, cached_prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = num_cached
                seq.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            if lora_int_id:
                loras.add(lora_int_id)
            num_slots_taken += num_slots
            batch.add(seq, num_new)
            budget -= num_new
            in_flight.update(self._completed_block_hashes(seq, num_new))
        self.waiting.extendleft(reversed(held_back))
        if self.speculator is not None and not preempted and budget > 0:
            self._add_drafts(batch, budget)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Give the step's decoding sequences that speculate their drafts, out of the token
        budget and the free blocks that the step leaves (a draft never displaces a prompt
        or preempts a sequence), each short enough that every token the step may emit
        fits in ``max_tokens`` and ``max_model_len``, and as long as the speculator finds
        it pays."""
        speculator = self.speculator
        assert speculator is not None
        decode_only = batch.num_tokens == len(batch.sampling_seqs)
        # (row of the batch, its sequence's drafter, the proposed draft)
        candidates: list[tuple[int, SequenceDrafter, list[int]]] = []
        for i, seq in enumerate(batch.seqs):
            drafter = seq.drafter
            if drafter is None or not batch.samples[i] or seq.num_output_tokens == 0:
                continue
            room = min(
                speculator.config.num_speculative_tokens,
                self.config.max_model_len - seq.num_tokens - 1,
            )
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - seq.num_output_tokens - 1)
            proposal = drafter.index.propose(seq.token_ids, room) if room > 0 else []
            if proposal:
                candidates.append((i, drafter, proposal))
        lengths = speculator.draft_lengths(
            [drafter.acceptance for _, drafter, _ in candidates],
            [len(proposal) for _, _, proposal in candidates],
            len(batch.sampling_seqs),
            batch.num_tokens,
            budget,
        )
        for (i, drafter, proposal), length in zip(candidates, lengths, strict=True):
            seq = batch.seqs[i]
            if length and self.block_manager.allocate_slots(seq, 1 + length):
                seq.draft = proposal[:length]
                batch.num_scheduled_tokens[i] += length
            else:
                drafter.idle()
        speculator.step_planned(batch.num_tokens, decode_only)

    def _running_loras(self) -> set[int]:
        """The adapters of the sequences holding places (running or paused)."""
        if self.config.max_loras is None:
            return set()
        return {seq.request.lora_int_id for seq in (*self.running, *self.paused)} - {0}

    def _completed_block_hashes(self, seq: Sequence, num_new: int) -> list[BlockHash]:
        """The hashes, where known yet, of the blocks that ``num_new`` more computed tokens
        fill for ``seq``."""
        size = self.block_manager.block_size
        start = seq.num_computed_tokens
        return seq.block_hashes[start // size : (start + num_new) // size]

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        # NOTE: a sequence awaiting an external step is paused, not queued: it has nothing
        # to compute until its owner gives it (or its forks) next tokens; `resume` and
        # `fork` queue them then.
        if seq.awaits_external_step:
            seq.status = SequenceStatus.PAUSED
            self.paused.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.num_preemptions == 1 or self.num_preemptions % 100 == 0:
            logger.warning(
                "Sequence %s was preempted because the KV cache ran out of blocks "
                "(%d preemptions so far); it will be recomputed, which costs time. To "
                "avoid it, give the cache more memory (kv_cache_memory_bytes or "
                "gpu_memory_utilization) or lower max_num_seqs or max_num_batched_tokens.",
                seq.request_id,
                self.num_preemptions,
            )

    def update(self, batch: ScheduledBatch, emitted: list[list[int]]) -> list[Sequence]:
        """Advance the batch by the step that just ran; return the sequences it finished.

        ``emitted`` holds the tokens of each sampling sequence, in batch order: one, or
        for a speculating sequence its accepted draft tokens and the token after them.
        Tokens are appended one at a time until one finishes the sequence; each list is
        cut, in place, to the tokens appended.
        """
        finished: list[Sequence] = []
        now = time.time()
        token_lists = iter(emitted)
        for seq, num_new, sample in zip(
            batch.seqs, batch.num_scheduled_tokens, batch.samples, strict=True
        ):
            draft = seq.draft
            # The draft's keys and values are valid as far as it is accepted, below.
            seq.num_computed_tokens += num_new - len(draft)
            if not draft:
                self.block_manager.cache_full_blocks(seq)
            if not sample:
                continue
            tokens = next(token_lists)
            if seq.request.tokens_chosen_externally:
                seq.awaits_external_step = True
                continue
            if seq.pending_forks:
                self._fork(seq)
            num_appended = 0
            for token in tokens:
                seq.token_ids.append(token)
                num_appended += 1
                if seq.grammar is not None:
                    seq.grammar.accept(token)
                if self._check_stop(seq):
                    finished.append(seq)
                    break
            if draft:
                seq.draft = []
                accepted = len(tokens) - 1
                seq.num_computed_tokens += min(num_appended, accepted)
                assert seq.drafter is not None and self.speculator is not None
                self.speculator.record(seq.drafter, len(draft), accepted)
                # NOTE: only now that the accepted tokens are the sequence's: the prefix
                # cache hashes its tokens, never a draft's.
                self.block_manager.cache_full_blocks(seq)
            del tokens[num_appended:]
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            seq.metrics.last_token_time = now
        for seq in batch.pooling_seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.finish_reason = FinishReason.STOP
                seq.metrics.first_token_time = seq.metrics.last_token_time = now
                finished.append(seq)
        for seq in finished:
            self.release(seq)
        return finished

    def _fork(self, parent: Sequence) -> None:
        """Start the parent's siblings on its computed prompt blocks."""
        for child in parent.pending_forks:
            self.fork(parent, child)
        parent.pending_forks = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child``, whose tokens extend the parent's computed ones, on the parent's
        full blocks. The fork of a paused parent (it holds no blocks) waits at the front of
        the queue instead, to be computed from the prefix cache where it can."""
        if parent.status is SequenceStatus.RUNNING:
            child.num_computed_tokens = self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.appendleft(child)

    def resume(self, seq: Sequence) -> None:
        """End the external step that ``seq`` awaited, its owner having appended its next
        tokens: a running sequence runs on, a paused one waits at the front of the queue to
        be computed again."""
        seq.awaits_external_step = False
        if seq.status is SequenceStatus.PAUSED:
            self.paused.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _check_stop(self, seq: Sequence) -> bool:
        params = seq.sampling_params
        token = seq.token_ids[-1]
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, None
                return True
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
                return True
        if seq.grammar is not None and seq.grammar.is_terminated:
            # The grammar ended on its stop token, also where ignore_eos or min_tokens
            # kept the EOS check above from ending the sequence.
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, None
            return True
        if (
            params.max_tokens is not None and num_output >= params.max_tokens
        ) or seq.num_tokens >= self.config.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
            return True
        return False

    def abort_all(self) -> None:
        """Drop every sequence and return all blocks to the pool.

        Safe after an interrupt anywhere in a step: the pool is rebuilt, not freed
        sequence by sequence, so a half-done allocation, fork or free leaks nothing.
        """
        for seq in [*self.running, *self.waiting, *self.paused]:
            # Siblings not forked yet, or forked by an interrupted `_fork`.
            for member in (seq, *seq.pending_forks):
                member.block_table.clear()
                member.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        self.paused.clear()
        self.block_manager.reset()

    def abort_request(self, request: Request) -> None:
        """Retire every sequence of ``request`` wherever it is: running, paused, queued, or
        a sibling not forked yet; their blocks return to the pool."""
        for seq in request.seqs:
            if seq.is_finished:
                continue
            # NOTE: a sibling not forked yet waits in its parent's pending_forks, not here.
            if seq.status is SequenceStatus.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
            seq.pending_forks = []
            self.release(seq)

    def stop_at_string(self, seq: Sequence, stop_str: str) -> None:
        """End a running sequence whose text reached one of its stop strings."""
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_str
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Retire a running sequence whose finish reason is set, or a running or paused one
        whose owner is done with it: free its blocks at once, stop running it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            self.paused.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.time()
        self.block_manager.free(seq)


def _num_slots_held(seq: Sequence) -> int:
    """Places ``seq`` holds in ``max_num_seqs``: its own, its ``n > 1`` siblings not forked
    yet, and those its owner reserved for the sequences it will start from it."""
    return 1 + len(seq.pending_forks) + seq.num_reserved_seqs
