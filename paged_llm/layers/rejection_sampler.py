"""Verifying a deterministic draft (n-gram speculation) against the target model, losslessly.

A draft token ``x`` at a position whose target distribution (after temperature, top-k/p,
min-p, penalties and bias) is ``p`` is accepted with probability ``p(x)``; the first
rejected one is replaced by a sample of ``p`` with ``x`` removed, and when every draft
token is accepted a bonus token is sampled from the distribution after the last. The
emitted tokens are then distributed exactly as tokens sampled from ``p`` one at a time
(speculative sampling with a one-hot draft distribution, where ``min(1, p/q)`` is
``p(x)`` and the residual ``max(0, p - q)`` is ``p`` without ``x``). Greedy requests accept
a draft token while it is the target's argmax.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """The tokens greedy decoding emits given ``target_logits`` ``[len(draft) + 1, V]``:
    the draft while it equals the argmax, then the argmax."""
    best = target_logits.argmax(dim=-1).tolist()
    emitted: list[int] = []
    for position, token in enumerate(draft):
        emitted.append(best[position])
        if token != best[position]:
            return emitted
    emitted.append(best[len(draft)])
    return emitted


def verify_sampled(
    target_probs: torch.Tensor, draft: list[int], generator: torch.Generator | None
) -> list[int]:
    """The tokens sampling emits given ``target_probs`` ``[len(draft) + 1, V]`` (each row
    a distribution), drawing from ``generator`` (a seeded request's own)."""
    emitted: list[int] = []
    for position, token in enumerate(draft):
        probs = target_probs[position]
        if torch.rand((), generator=generator, device=probs.device) < probs[token]:
            emitted.append(token)
            continue
        residual = probs.clone()
        residual[token] = 0
        emitted.append(_sample(residual, generator))
        return emitted
    emitted.append(_sample(target_probs[len(draft)], generator))
    return emitted


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to ``weights``."""
    return int(torch.multinomial(weights.float(), 1, generator=generator).item())
