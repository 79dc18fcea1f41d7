"""N-gram speculative decoding: drafts, the acceptance rule, and the rule that decides how
much to draft.

**Drafts.** A sequence's draft is what followed the most recent earlier occurrence of the
longest suffix of its tokens (``prompt_lookup_min`` .. ``_max`` tokens long) in its prompt
and output (`NgramIndex`). The scheduler appends it to the sequence's last token for one step;
the forward computes all of them, and the sampler scores every position.

**Acceptance, lossless.** Logits row ``i`` of a speculating sequence is its distribution
after the first ``i`` draft tokens, and the sampler draws a token from each row exactly as
it would have drawn that position's token without speculation: the same processing
(penalties, bias, bans and min_tokens see the draft tokens before it as output) and, for a
random row, the same uniform, which the sampler derives from (seed, position) alone. A draft
token is accepted while it equals the token drawn at its position (`num_accepted`); the
emitted tokens are the accepted ones and the token drawn after them. So every request emits
the very tokens it emits without speculation, greedy or seeded. For a random row this is
speculative sampling with a deterministic draft: the draft token ``x`` is accepted with
probability ``p(x)``, and when it is not, the drawn token is distributed as ``p`` without
``x``.

**How much to draft.** A verified position costs the forward a token; at batch 1 a CPU or
GPU step is bound by reading the weights and extra tokens are nearly free, at batch 64 a CPU
step is bound by arithmetic and every draft token costs about as much as a decoded one. Two
measured rules bound the draft (`AdaptiveDrafting`):

- per step: for its band of batch sizes (1, 2-3, 4-7, ...), the draft cap whose decode
  steps emitted the most tokens per second, each cap re-measured every few steps;
- per sequence: its recent acceptance ``a`` (per drafted token) bounds its draft to the run it
  is expected to accept plus one (``a / (1 - a) + 1``), at least one token, so that the
  estimate stays current.

Whatever they decide, the tokens are the same: only the speed changes.
"""

from __future__ import annotations

from collections.abc import Sequence as TokenSequence
from dataclasses import dataclass, field

from paged_llm.speculative import SpeculativeConfig


class NgramIndex:
    """The n-gram index of one growing token sequence: per n-gram length, the n-gram ->
    where its most recent occurrence ended, updated as tokens arrive (``max_n - min_n + 1``
    dictionary writes a token), so that a draft costs a few lookups, never a scan."""

    __slots__ = ("_ends", "_num_indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # Positions whose n-grams ending there are indexed: all but the last token seen. The
        # suffix joins the index one token late: looked up, it would find itself, with
        # nothing after it.
        self._num_indexed = 0

    def propose(self, tokens: TokenSequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens after ``tokens`` (which extend the tokens of the
        earlier calls): what followed the most recent earlier occurrence of the longest
        matching suffix; empty where no suffix recurs."""
        for end in range(self._num_indexed + 1, len(tokens)):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        length = len(tokens)
        self._num_indexed = max(self._num_indexed, length - 1)
        for n in range(self.max_n, self.min_n - 1, -1):
            if length < n:
                continue
            found = self._ends[n].get(tuple(tokens[length - n :]))
            if found is not None:
                return list(tokens[found : found + num_tokens])
        return []


def num_accepted(drawn: TokenSequence[int], draft: TokenSequence[int]) -> int:
    """Draft tokens accepted: the leading ones equal to the token drawn at their position
    (``drawn[i]``: the token drawn after the first ``i`` draft tokens)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == drawn[accepted]:
        accepted += 1
    return accepted


# Prior of a sequence's acceptance, as drafted tokens: one accepted, one rejected.
_PRIOR_ACCEPTED = _PRIOR_REJECTED = 1.0
# Weight of a sequence's earlier drafts at each new one: its acceptance follows the text.
_ACCEPTANCE_MEMORY = 0.7


class SequenceDrafts:
    """One sequence's n-gram index and recent acceptance."""

    __slots__ = ("_accepted", "_rejected", "index")

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self._accepted = _PRIOR_ACCEPTED
        self._rejected = _PRIOR_REJECTED

    @property
    def acceptance(self) -> float:
        """Recent share of drafted tokens accepted, given the ones before them were."""
        return self._accepted / (self._accepted + self._rejected)

    def propose(self, tokens: TokenSequence[int], max_tokens: int) -> list[int]:
        """The draft after ``tokens``: at most ``max_tokens``, and at most the run the recent
        acceptance expects plus one."""
        acceptance = self.acceptance
        worthwhile = max(1, round(acceptance / (1.0 - acceptance)) + 1)
        return self.index.propose(tokens, min(max_tokens, worthwhile))

    def record(self, num_drafted: int, accepted: int) -> None:
        self._accepted = _ACCEPTANCE_MEMORY * self._accepted + accepted
        self._rejected = _ACCEPTANCE_MEMORY * self._rejected + (accepted < num_drafted)


# A band re-measures one of its other caps every this many steps.
_REMEASURE_EVERY = 16
# Weight of a new measurement of a cap's rate.
_RATE_WEIGHT = 0.3
# Measurements of each cap before a band trusts its rates.
_FIRST_MEASUREMENTS = 2


@dataclass(slots=True)
class _Band:
    """The measured decode rates of one band of batch sizes: cap -> output tokens per second
    (an exponential average), and how often each was measured."""

    rates: dict[int, float] = field(default_factory=dict)
    measured: dict[int, int] = field(default_factory=dict)
    num_steps: int = 0


class AdaptiveDrafting:
    """The per-step draft cap (see the module docstring): for each band of batch sizes, the
    cap with the best measured decode rate. Every ``_REMEASURE_EVERY``-th step of a band
    re-measures another cap, in turn, so that the choice follows the workload; until each
    cap has been measured twice, the band tries them in turn, largest first."""

    def __init__(self, num_speculative_tokens: int) -> None:
        caps = {0, num_speculative_tokens}
        cap = 1
        while cap < num_speculative_tokens:
            caps.add(cap)
            cap *= 2
        self.caps = sorted(caps, reverse=True)
        self._bands: dict[int, _Band] = {}
        self._next_remeasured = 0

    def choose(self, batch_size: int) -> int:
        band = self._bands.setdefault(batch_size.bit_length(), _Band())
        band.num_steps += 1
        for cap in self.caps:
            if band.measured.get(cap, 0) < _FIRST_MEASUREMENTS:
                return cap
        best = max(self.caps, key=band.rates.__getitem__)
        if band.num_steps % _REMEASURE_EVERY:
            return best
        others = [cap for cap in self.caps if cap != best]
        self._next_remeasured += 1
        return others[self._next_remeasured % len(others)]

    def record(self, batch_size: int, cap: int, num_emitted: int, seconds: float) -> None:
        """A decode step (no prompt tokens) of ``batch_size`` sequences under ``cap``."""
        band = self._bands[batch_size.bit_length()]
        rate = num_emitted / max(seconds, 1e-9)
        count = band.measured.get(cap, 0)
        band.rates[cap] = (
            rate if count == 0 else (1 - _RATE_WEIGHT) * band.rates[cap] + (_RATE_WEIGHT * rate)
        )
        band.measured[cap] = count + 1


@dataclass(slots=True)
class SpeculationCounts:
    """vLLM's speculative-decoding counters: drafts verified, draft tokens, accepted ones
    (also per draft position), and tokens the speculating sequences emitted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class Speculator:
    """The scheduler's side of speculation: the step's draft cap, each sequence's draft, and
    what verification made of them."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.adaptive = AdaptiveDrafting(config.num_speculative_tokens) if config.adaptive else None
        self.counts = SpeculationCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        # The current step's (batch size, cap) when it is a decode step the rule measures.
        self._measured_step: tuple[int, int] | None = None

    def step_cap(self, batch_size: int, decode_only: bool) -> int:
        """Most draft tokens per sequence in a step of ``batch_size`` sampling sequences."""
        self._measured_step = None
        if self.adaptive is None:
            return self.config.num_speculative_tokens
        cap = self.adaptive.choose(batch_size)
        if decode_only:
            self._measured_step = (batch_size, cap)
        return cap

    def step_done(self, num_emitted: int, seconds: float) -> None:
        """The step ended, emitting ``num_emitted`` tokens in ``seconds``."""
        if self._measured_step is not None and self.adaptive is not None:
            self.adaptive.record(*self._measured_step, num_emitted, seconds)
        self._measured_step = None
