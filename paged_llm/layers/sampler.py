"""Turns the logits of a batch into tokens, all rows at once.

Random draws come from a counter-based generator: the uniform number behind a request's
k-th token is a hash of (request seed, k). It does not depend on which other requests
share the batch, where the request sits in it, or whether it was preempted and
recomputed, so seeded requests are reproducible under any batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer over int64 tensors holding values in [0, 2^32).

    The multiplier is below 2^31, so products stay below 2^63 and never overflow int64.
    """
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per row, determined by (seed, counter) alone."""
    key = _hash32(seeds & _MASK32 ^ _hash32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9))
    high = _hash32(key ^ _hash32(counters & _MASK32))
    low = _hash32(high ^ 0x85EBCA6B)
    return ((high >> 5) * 67108864 + (low >> 6)).double() / 9007199254740992.0


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    seeds: torch.Tensor  # [B] int64
    # [B] int64: index of the token being drawn among the row's generated tokens.
    counters: torch.Tensor
    all_greedy: bool


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``logits`` ``[B, V]`` float32; returns ``[B]`` int64 token ids."""
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_tokens
        temperature = metadata.temperature
        safe_temperature = torch.where(temperature > 0, temperature, 1.0)
        probs = torch.softmax(logits / safe_temperature[:, None], dim=-1)
        sampled = _inverse_cdf_sample(probs, counter_uniform(metadata.seeds, metadata.counters))
        return torch.where(temperature > 0, sampled, greedy_tokens)


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds each row's uniform.

    The cumulative sum runs in float64 so that rounding cannot move probability mass
    between tokens of a 100k-entry vocabulary.
    """
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return tokens.clamp_max(probs.shape[-1] - 1)
