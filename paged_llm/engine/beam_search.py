"""Beam search inside the engine, with vLLM's rules.

A beam search request starts as one sequence, its prompt. Its beams run through the
scheduler like any sequence, asking the model runner for ``2 * beam_width`` logprobs, so
that one forward scores every beam of every request. Once all live beams of a request are
scored, `BeamSearcher.step` picks its next beams:

- every beam offers the ``2 * beam_width`` most likely next tokens of the model's raw
  distribution (and, above temperature 0, the token the sampler drew where it is not
  among them), each scored ``cum_logprob + logprob``;
- a candidate ending in EOS (unless ``ignore_eos``) completes: it is set aside, finished;
- the ``beam_width`` best other candidates are the next beams. The first taken from a beam
  continues that beam's sequence in place; each further one forks it, sharing its full
  blocks (`Scheduler.fork`) and recomputing only the partial last block. A beam nothing
  was taken from is released at once, and its blocks with it.

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

from paged_llm.engine.scheduler import Scheduler
from paged_llm.engine.sequence import FinishReason, RawLogprobs, Request, Sequence, derive_seed
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
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
        return self.cum_logprob / length**length_penalty


@dataclass(slots=True)
class BeamSearchState:
    """One request's search: its live beams (best first) and the beams finished so far."""

    params: BeamSearchParams
    # params.max_tokens, or fewer where max_model_len ends the sequences first.
    max_tokens: int
    base_seed: int
    beams: list[Beam]
    finished: list[FinishedBeam] = field(default_factory=list)
    # Sequences made so far: the next fork's index (and seed).
    num_seqs: int = 1
    # The beam_width best finished beams, best first, once the search is over.
    result: list[FinishedBeam] | None = None


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

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        base_seed: int,
        grammar: SequenceGrammar | None,
    ) -> Request:
        """Queue a validated beam search; the first beam is the prompt itself, with the
        request's grammar, if any (each fork continues a copy of its parent's)."""
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
            params.max_tokens, self.scheduler.config.max_model_len - len(prompt_token_ids)
        )
        state = BeamSearchState(params, max_tokens, base_seed, beams=[])
        request = Request(
            request_id, prompt, prompt_token_ids, sampling_params, time.time(), beam_search=state
        )
        root = Sequence(next(self._seq_ids), request, derive_seed(base_seed, 0), 0, grammar)
        state.beams.append(Beam(root, 0.0))
        request.seqs = [root]
        self.scheduler.add(root)
        return request

    def step(self, seqs: list[Sequence]) -> list[Request]:
        """Advance the searches whose beams are all scored now; ``seqs`` are the sequences
        the step scored. Return the requests whose search is over (``result`` set)."""
        requests = {
            id(seq.request): seq.request for seq in seqs if seq.request.beam_search is not None
        }
        finished = []
        for request in requests.values():
            state = request.beam_search
            assert state is not None
            if all(beam.seq.awaits_beam_step for beam in state.beams) and self._advance(
                request, state
            ):
                finished.append(request)
        return finished

    def _advance(self, request: Request, state: BeamSearchState) -> bool:
        """One beam step; return whether the search is over."""
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
            state.result = sorted(
                state.finished, key=lambda b: b.score(params.length_penalty), reverse=True
            )[: params.beam_width]
            return True

        # Forks first: they copy their parent's tokens before it appends its own.
        next_tokens: dict[int, int] = {}
        next_beams = []
        for parent, token_id, cum_logprob in chosen:
            if parent.seq_id in next_tokens:
                child = self._fork(request, state, parent, token_id)
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
                self.scheduler.continue_beam(seq)
        state.beams = next_beams
        request.seqs = [beam.seq for beam in next_beams]
        return False

    def _fork(
        self, request: Request, state: BeamSearchState, parent: Sequence, token_id: int
    ) -> Sequence:
        index = state.num_seqs
        state.num_seqs += 1
        grammar = None
        if parent.grammar is not None:
            grammar = parent.grammar.fork()
            grammar.accept(token_id)
        child = Sequence(
            next(self._seq_ids), request, derive_seed(state.base_seed, index), index, grammar
        )
        child.token_ids = [*parent.token_ids, token_id]
        child.logprobs = list(parent.logprobs)
        child.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.fork(parent, child)
        return child
