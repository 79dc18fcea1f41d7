"""Sequences for engine tests that run without a model."""

from __future__ import annotations

import itertools

from paged_llm.engine.sequence import Request, Sequence
from paged_llm.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(prompt_token_ids: list[int], **params: object) -> Sequence:
    """A fresh single-sequence request over these prompt tokens."""
    seq_id = next(_ids)
    request = Request(str(seq_id), None, list(prompt_token_ids), SamplingParams(**params), 0.0)
    request.seqs = [Sequence(seq_id, request, seed=0)]
    return request.seqs[0]
