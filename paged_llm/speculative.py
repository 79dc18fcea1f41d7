"""`SpeculativeConfig`: vLLM's ``speculative_config`` for n-gram (prompt-lookup) drafts,
checked on construction: an unknown key or method, or a value out of range, is a ValueError
naming the key."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# vLLM's methods that need a draft model or extra heads: named in the refusal.
_DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` "ngram": up to ``num_speculative_tokens`` draft tokens per step, from the
    most recent earlier occurrence of the longest suffix of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens (vLLM's defaults: both 5 when neither is given, one
    standing for the other when only one is). ``adaptive`` is paged_llm's own key."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Not a vLLM key. True: per step, draft only as much as measured to pay (see
    # engine/speculation.py); False: always up to num_speculative_tokens (to measure that).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method in ("[ngram]",):
            object.__setattr__(self, "method", "ngram")
        if self.method != "ngram":
            needs = (
                "a draft model or extra heads"
                if self.method in _DRAFT_MODEL_METHODS
                else "a method paged_llm does not know"
            )
            raise ValueError(
                f"speculative_config['method']={self.method!r} is {needs}; paged_llm "
                "speculates with n-gram prompt lookup only: method='ngram'."
            )
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            required = key == "num_speculative_tokens"
            if (value is not None or required) and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                raise ValueError(
                    f"speculative_config[{key!r}] must be an int >= 1"
                    + (" (it is required)" if required else " or None")
                    + f", got {value!r}."
                )
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config['adaptive'] must be a bool, got {self.adaptive!r}."
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        if low > high:  # type: ignore[operator]
            raise ValueError(
                f"speculative_config['prompt_lookup_min']={low} must be <= "
                f"speculative_config['prompt_lookup_max']={high}."
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config of ``LLM(speculative_config=...)``: a dict with vLLM's keys."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict (vLLM's keys: method, "
                "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min) or None, got "
                f"{type(value).__name__}."
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"Unknown speculative_config key(s) {unknown}; paged_llm's n-gram "
                f"speculation takes {', '.join(known)}."
            )
        if "num_speculative_tokens" not in value:
            raise ValueError(
                "speculative_config['num_speculative_tokens'] is required: how many draft "
                "tokens a step may verify."
            )
        return cls(**value)
