"""Beam search inside the engine, with vLLM's rules.

A beam search request starts as one sequence, its prompt. Its beams run through the
scheduler like any sequence, asking the model runner for ``2 * beam_width`` logprobs, so
that one forward scores every beam of every request. The request chooses its tokens
externally (``Request.tokens_chosen_externally``), so the scheduler appends no sampled
token to a scored beam: the beam awaits an external step (skipped, and paused without its
blocks where others need them) until all live beams of its request are scored. Then
`BeamSearcher.step` picks the request's next beams:

- every beam offers the ``2 * beam_width`` most likely next tokens of the model's raw
  distribution (and, above temperature 0, the token the sampler drew where it is not
  among them), each scored ``cum_logprob + logprob``;
- a candidate ending in EOS (unless ``ignore_eos``) completes: it is set aside, finished;
- the ``beam_width`` best other candidates are the next beams. The first taken from a beam
  continues that beam's sequence in place (`Scheduler.resume`); each further one forks
  it, sharing its full blocks (`Scheduler.fork`) and recomputing only the partial last
  block. A beam nothing was taken from is released at once, and its blocks with it.

The best beam reserves places in ``max_num_seqs`` for the beams its request lacks of
``beam_width`` (``Sequence.num_reserved_seqs``), so that forks always find one. The search
state stays here, in `BeamSearcher.searches`; the engine's core knows only the generic
state.

After ``max_tokens`` steps (or at ``max_model_len``) the live beams finish too ("length"),
and the result is the ``beam_width`` best of all finished beams by
``cum_logprob / len ** length_penalty``, best first, where ``len`` counts the prompt and
the generated tokens but not the EOS that ended a beam.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from paged_llm.engine.request import EngineRequest
from paged_llm.engine.scheduler import Scheduler
from paged_llm.engine.sequence import FinishReason, RawLogprobs, Request, Sequence
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.seeds import derive_seed
from paged_llm.structured_outputs.xgrammar_backend import SequenceGrammar


@dataclass(slots=True)
class Beam:
    seq: Sequence
    cum_logprob: float


@dataclass(slots=True)
class FinishedBeam:
    """A beam the search is done with: its tokens (prompt included) and the logprob rows of
    its generated positions."""

    token_ids: list[int]
    logprobs: list[RawLogprobs]
    cum_logprob: float
    finish_reason: FinishReason
    stop_reason: int | None = None

    def score(self, length_penalty: float) -> float:
        length = len(self.token_ids) - (self.finish_reason is FinishReason.STOP)
        # int ** float is typed Any (a negative base gives a complex); length is positive.
        penalty: float = length**length_penalty
        return self.cum_logprob / penalty


@dataclass(slots=True)
class BeamSearchState:
    """One request's search: its live beams (best first) and the beams finished so far."""

    request: Request
    params: BeamSearchParams
    # params.max_tokens, or fewer where max_model_len ends the sequences first.
    max_tokens: int
    base_seed: int
    beams: list[Beam]
    finished: list[FinishedBeam] = field(default_factory=list)
    # Sequences made so far: the next fork's index (and seed).
    num_seqs: int = 1


def _candidates(row: RawLogprobs) -> Iterator[tuple[int, float]]:
    """A beam's next tokens, in the order of vLLM's logprobs dict: the sampled token, then
    the top tokens by rank (each once), less those a grammar rules out (logprob -inf)."""
    token_ids, logprobs, _ = row
    yield token_ids[0], logprobs[0]
    for token_id, logprob in zip(token_ids[1:], logprobs[1:], strict=True):
        if token_id != token_ids[0] and logprob != -math.inf:
            yield token_id, logprob


class BeamSearcher:
    """Starts beam search requests and advances them as their beams are scored."""

    def __init__(
        self, scheduler: Scheduler, eos_token_ids: frozenset[int], seq_ids: Iterator[int]
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        # Shared with the engine: sequence ids are unique across all requests.
        self._seq_ids = seq_ids
        # The searches not over yet, by request id.
        self.searches: dict[str, BeamSearchState] = {}

    def add_request(
        self, request: EngineRequest, base_seed: int, grammar: SequenceGrammar | None
    ) -> Request:
        """Queue a validated beam search; the first beam is the prompt itself, with the
        request's grammar, if any (each fork continues a copy of its parent's)."""
        params = request.params
        assert isinstance(params, BeamSearchParams)
        # NOTE: the runner computes logprobs (and, above temperature 0, draws a token) for
        # these params; the beam search alone decides what a beam appends, so nothing in
        # them ends a sequence.
        sampling_params = SamplingParams(
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            max_tokens=None,
            ignore_eos=True,
            detokenize=False,
        )
        max_tokens = min(
            params.max_tokens,
            self.scheduler.config.max_model_len - len(request.prompt_token_ids),
        )
        state = Request(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            sampling_params,
            time.time(),
            tokens_chosen_externally=True,
            lora_request=request.lora_request,
        )
        root = Sequence(next(self._seq_ids), state, derive_seed(base_seed, 0), 0, grammar)
        root.num_reserved_seqs = params.beam_width - 1
        state.seqs = [root]
        self.searches[request.request_id] = BeamSearchState(
            state, params, max_tokens, base_seed, beams=[Beam(root, 0.0)]
        )
        self.scheduler.add(root)
        return state

    def step(self, seqs: list[Sequence]) -> list[tuple[Request, list[FinishedBeam]]]:
        """Advance the searches whose beams are all scored now; ``seqs`` are the sequences
        the step scored. Return each search that is over with its ``beam_width`` best
        beams, best first."""
        # In the order of the step's sequences: forks take sequence ids in that order.
        scored = {
            seq.request_id: search
            for seq in seqs
            if (search := self.searches.get(seq.request_id)) is not None
        }
        finished = []
        for request_id, state in scored.items():
            if all(beam.seq.awaits_external_step for beam in state.beams):
                result = self._advance(state)
                if result is not None:
                    del self.searches[request_id]
                    finished.append((state.request, result))
        return finished

    def abort(self, request_id: str) -> None:
        """Forget one search (`Scheduler.abort_request` drops its sequences)."""
        self.searches.pop(request_id, None)

    def abort_all(self) -> None:
        """Forget every search (`Scheduler.abort_all` drops their sequences)."""
        self.searches.clear()

    def _advance(self, state: BeamSearchState) -> list[FinishedBeam] | None:
        """One beam step; return the result once the search is over."""
        request = state.request
        params = state.params
        candidates: list[tuple[Sequence, int, float]] = []
        for beam in state.beams:
            seq = beam.seq
            for token_id, logprob in _candidates(seq.logprobs[-1]):
                cum_logprob = beam.cum_logprob + logprob
                # NOTE: a grammar allows EOS only once it is complete, and nothing after it.
                if token_id in self.eos_token_ids and (
                    not params.ignore_eos or seq.grammar is not None
                ):
                    state.finished.append(
                        FinishedBeam(
                            [*seq.token_ids, token_id],
                            list(seq.logprobs),
                            cum_logprob,
                            FinishReason.STOP,
                            token_id,
                        )
                    )
                else:
                    candidates.append((seq, token_id, cum_logprob))
        # NOTE: the candidates all have the same length, so the score orders them as
        # cum_logprob does. The sort is stable: ties stay in beam, then rank order, as
        # vLLM's do.
        candidates.sort(key=lambda candidate: candidate[2], reverse=True)
        chosen = candidates[: params.beam_width]
        now = time.time()
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now

        if not chosen or state.beams[0].seq.num_output_tokens + 1 >= state.max_tokens:
            state.finished.extend(
                FinishedBeam(
                    [*seq.token_ids, token_id], list(seq.logprobs), cum_logprob, FinishReason.LENGTH
                )
                for seq, token_id, cum_logprob in chosen
            )
            for beam in state.beams:
                self.scheduler.release(beam.seq)
            return sorted(
                state.finished, key=lambda b: b.score(params.length_penalty), reverse=True
            )[: params.beam_width]

        # Forks first: they copy their parent's tokens before it appends its own.
        next_tokens: dict[int, int] = {}
        next_beams = []
        for parent, token_id, cum_logprob in chosen:
            if parent.seq_id in next_tokens:
                child = self._fork(state, parent, token_id)
            else:
                next_tokens[parent.seq_id] = token_id
                child = parent
            next_beams.append(Beam(child, cum_logprob))
        for beam in state.beams:
            seq = beam.seq
            next_token = next_tokens.get(seq.seq_id)
            if next_token is None:
                self.scheduler.release(seq)
            else:
                seq.token_ids.append(next_token)
                if seq.grammar is not None:
                    seq.grammar.accept(next_token)
                self.scheduler.resume(seq)
        # NOTE: only the best beam holds the reservation, so that it is counted once.
        state.beams[0].seq.num_reserved_seqs = 0
        next_beams[0].seq.num_reserved_seqs = params.beam_width - len(next_beams)
        state.beams = next_beams
        request.seqs = [beam.seq for beam in next_beams]
        return None

    def _fork(self, state: BeamSearchState, parent: Sequence, token_id: int) -> Sequence:
        index = state.num_seqs
        state.num_seqs += 1
        grammar = None
        if parent.grammar is not None:
            grammar = parent.grammar.fork()
            grammar.accept(token_id)
        child = Sequence(
            next(self._seq_ids), state.request, derive_seed(state.base_seed, index), index, grammar
        )
        child.token_ids = [*parent.token_ids, token_id]
        child.logprobs = list(parent.logprobs)
        child.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.fork(parent, child)
        return child
