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
step is bound by arithmetic and every draft token costs about as much as a decoded one. The
rule weighs both per step (`DraftPlanner`): decode steps are timed and fitted as ``fixed +
per_token x tokens`` (`StepCostModel`); a sequence's ``j``-th draft token is expected to add
``a x c ** (j - 1)`` tokens, ``a`` the sequence's recent acceptance of a draft's first token
(`SequenceDrafter`) and ``c`` the engine's rate of accepting a draft token after an accepted
one (drafts tend to be accepted whole or soon rejected: copying goes on); draft
tokens are taken, the most promising first, while each raises the step's expected tokens per
second, with a margin: while ``a x c ** (j - 1) > 1.5 x per_token x rate``, the rate being the step's expected tokens over
its expected seconds so far. Until the fit exists (the first decode steps, or steps of one
size only), steps verify the drafts whole and one token of each in turn, which gives the fit
steps of two sizes. The fit is linear where the cost is concave (the first
tokens a step adds cost the most): where drafting pays only when whole, the rule stays
safe and leaves some speed (batch 16 of copy-heavy requests on a CPU, benchmarks.md).

Whatever it decides, the tokens are the same: only the speed changes.
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


# Weight of a sequence's earlier drafts at each new one: its acceptance follows the text.
_ACCEPTANCE_MEMORY = 0.7
# Weight of its earlier drafts at each step it proposed a draft the plan did not take: the
# estimate returns toward the prior, so that a sequence is tried again.
_IDLE_MEMORY = 0.9


class SequenceDrafter:
    """One sequence's n-gram index and how often its drafts' first token is accepted
    lately."""

    __slots__ = ("_accepted", "_rejected", "index")

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        # Decayed counts of first draft tokens accepted and rejected.
        self._accepted = self._rejected = 0.0

    @property
    def acceptance(self) -> float:
        """The chance its next draft's first token is accepted (prior: one half)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def record(self, accepted: int) -> None:
        self._accepted = _ACCEPTANCE_MEMORY * self._accepted + (accepted > 0)
        self._rejected = _ACCEPTANCE_MEMORY * self._rejected + (accepted == 0)

    def idle(self) -> None:
        """It proposed a draft that the plan did not take."""
        self._accepted *= _IDLE_MEMORY
        self._rejected *= _IDLE_MEMORY


# Weight of the earlier steps in the cost fit at each new one: about the last 20 steps count.
_COST_MEMORY = 0.95
# Least spread of step sizes (tokens squared) that fits a per-token cost; below it the last
# fitted per-token cost stays.
_MIN_SIZE_VARIANCE = 0.1


class StepCostModel:
    """Seconds of a decode step as ``fixed + per_token x tokens``, fitted by least squares
    to the recent steps (exponentially weighted)."""

    def __init__(self) -> None:
        self._weight = self._tokens = self._tokens_squared = 0.0
        self._seconds = self._tokens_seconds = 0.0
        self.per_token: float | None = None

    def record(self, num_tokens: int, seconds: float) -> None:
        self._weight = _COST_MEMORY * self._weight + 1.0
        self._tokens = _COST_MEMORY * self._tokens + num_tokens
        self._tokens_squared = _COST_MEMORY * self._tokens_squared + num_tokens**2
        self._seconds = _COST_MEMORY * self._seconds + seconds
        self._tokens_seconds = _COST_MEMORY * self._tokens_seconds + num_tokens * seconds
        mean_tokens = self._tokens / self._weight
        variance = self._tokens_squared / self._weight - mean_tokens**2
        if variance >= _MIN_SIZE_VARIANCE:
            covariance = (
                self._tokens_seconds / self._weight - mean_tokens * self._seconds / self._weight
            )
            self.per_token = max(covariance / variance, 0.0)

    @property
    def fixed(self) -> float | None:
        """The per-step cost, through the recent steps' mean under the fitted slope."""
        if self.per_token is None:
            return None
        mean_tokens = self._tokens / self._weight
        return max(self._seconds / self._weight - self.per_token * mean_tokens, 0.0)


# A draft token is taken where it is expected to add this many times what it costs: the
# fit is linear where the cost is not quite, and estimates are noisy.
_MARGIN = 1.5


class DraftPlanner:
    """How many of their proposed draft tokens a step's sequences verify (see the module
    docstring)."""

    def __init__(self) -> None:
        self.cost = StepCostModel()
        self._num_probes = 0
        # Draft tokens after an accepted one, and how many of them were accepted
        # (cumulative, prior one each): the chance that a draft goes on being accepted.
        self._num_continued = self._num_continuations = 1.0

    @property
    def continuation(self) -> float:
        """The chance a draft token is accepted, given the one before it was."""
        return self._num_continued / (self._num_continuations + 1.0)

    def record(self, num_drafted: int, accepted: int) -> None:
        self._num_continuations += min(accepted, num_drafted - 1)
        self._num_continued += max(accepted - 1, 0)

    def plan(
        self,
        acceptances: list[float],
        proposed: list[int],
        num_sampling: int,
        num_tokens: int,
        budget: int,
    ) -> list[int]:
        """Draft lengths for sequences of these recent ``acceptances`` and ``proposed``
        draft lengths, in a step of ``num_sampling`` sampling sequences and ``num_tokens``
        tokens before drafts, with ``budget`` tokens left."""
        fixed, per_token = self.cost.fixed, self.cost.per_token
        if fixed is None or per_token is None:
            # Steps of two sizes for the fit: drafts verified whole, then one token of each,
            # in turn.
            self._num_probes += 1
            whole = self._num_probes % 2 == 1
            return _within_budget(
                [length if whole else min(1, length) for length in proposed], budget
            )
        lengths = [0] * len(proposed)
        expected_tokens, tokens = float(num_sampling), num_tokens
        # The j-th token of a draft adds acceptance * continuation ** (j - 1): within a
        # sequence the values fall, so taking the largest first takes prefixes.
        continuation = self.continuation
        candidates = sorted(
            (
                (acceptance * continuation ** (position - 1), index)
                for index, (acceptance, length) in enumerate(
                    zip(acceptances, proposed, strict=True)
                )
                for position in range(1, length + 1)
            ),
            reverse=True,
        )
        for value, index in candidates[:budget]:
            rate = expected_tokens / (fixed + per_token * tokens)
            if value <= _MARGIN * per_token * rate:
                break
            lengths[index] += 1
            expected_tokens += value
            tokens += 1
        return lengths


def _within_budget(lengths: list[int], budget: int) -> list[int]:
    kept = []
    for length in lengths:
        kept.append(min(length, budget))
        budget -= kept[-1]
    return kept


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
    """The scheduler's side of speculation: each step's drafts, the step timings the plan
    learns from, and what verification made of the drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.planner = DraftPlanner() if config.adaptive else None
        self.counts = SpeculationCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        # The current step's tokens, when it is a decode step the cost fit learns from.
        self._timed_step: int | None = None

    def draft_lengths(
        self,
        acceptances: list[float],
        proposed: list[int],
        num_sampling: int,
        num_tokens: int,
        budget: int,
    ) -> list[int]:
        """How much of each proposal to verify (`DraftPlanner.plan`; all of it, within the
        budget, without the adaptive rule)."""
        if self.planner is None:
            return _within_budget(proposed, budget)
        return self.planner.plan(acceptances, proposed, num_sampling, num_tokens, budget)

    def record(self, drafter: SequenceDrafter, num_drafted: int, accepted: int) -> None:
        """A draft of ``num_drafted`` tokens was verified, ``accepted`` of them accepted."""
        drafter.record(accepted)
        self.counts.record(num_drafted, accepted)
        if self.planner is not None:
            self.planner.record(num_drafted, accepted)

    def step_planned(self, num_tokens: int, decode_only: bool) -> None:
        """The step about to run: ``num_tokens`` tokens, drafts included; ``decode_only``:
        every sequence of it decodes."""
        self._timed_step = num_tokens if decode_only else None

    def step_done(self, seconds: float) -> None:
        if self._timed_step is not None and self.planner is not None:
            self.planner.cost.record(self._timed_step, seconds)
        self._timed_step = None
