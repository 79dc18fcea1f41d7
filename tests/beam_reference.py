"""A straightforward beam search to check the engine's against: every step recomputes the
whole sequence of every beam, with vLLM's rules (see paged_llm/engine/beam_search.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paged_llm import BeamSearchParams

# (sequences of one length, count) -> per sequence, its ``count`` most likely next tokens
# and their logprobs, most likely first.
TopCandidates = Callable[[list[list[int]], int], list[list[tuple[int, float]]]]


@dataclass(frozen=True)
class ReferenceBeam:
    tokens: list[int]
    cum_logprob: float
    finish_reason: str


def reference_beam_search(
    top_candidates: TopCandidates,
    prompt: list[int],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> list[ReferenceBeam]:
    width = params.beam_width
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    finished: list[ReferenceBeam] = []
    for _ in range(min(params.max_tokens, max_model_len - len(prompt))):
        candidates: list[tuple[list[int], float]] = []
        tops = top_candidates([tokens for tokens, _ in beams], 2 * width)
        for (tokens, cum_logprob), top in zip(beams, tops, strict=True):
            for token_id, logprob in top:
                extended = ([*tokens, token_id], cum_logprob + logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    finished.append(ReferenceBeam(*extended, "stop"))
                else:
                    candidates.append(extended)
        beams = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:width]
        if not beams:
            break
    finished += [ReferenceBeam(tokens, cum_logprob, "length") for tokens, cum_logprob in beams]

    def score(beam: ReferenceBeam) -> float:
        length = len(beam.tokens) - (beam.finish_reason == "stop")
        return beam.cum_logprob / length**params.length_penalty

    return sorted(finished, key=score, reverse=True)[:width]
