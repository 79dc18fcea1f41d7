"""Sampling parameters for text generation, with vLLM's field names, defaults and meaning."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from paged_llm.exceptions import VLLMValidationError
from paged_llm.structured_outputs.params import StructuredOutputsParams

# Below this temperature sampling is greedy, as in vLLM.
_GREEDY_EPS = 1e-5

_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)

_T = TypeVar("_T")


class _ListField(Generic[_T]):
    """A dataclass field that stores what it is given (a list or None) as a list.

    The constructor keeps vLLM's types, None included, while every reader gets ``list[_T]``
    and never checks for None: type checkers take ``__init__``'s parameter type from
    ``__set__`` and the attribute's type from ``__get__``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = f"_{name}"

    # On the class (obj None) the dataclass machinery reads the field's default: None.
    @overload
    def __get__(self, obj: None, owner: type) -> None: ...
    @overload
    def __get__(self, obj: object, owner: type) -> list[_T]: ...
    def __get__(self, obj: object | None, owner: type) -> list[_T] | None:
        if obj is None:
            return None
        value: list[_T] = getattr(obj, self._attr)
        return value

    def __set__(self, obj: object, value: list[_T] | None) -> None:
        setattr(obj, self._attr, list(value or []))


class _StopStrings(_ListField[str]):
    """``stop``, which also takes a single string, as in vLLM."""

    def __set__(self, obj: object, value: str | list[str] | None) -> None:
        super().__set__(obj, [value] if isinstance(value, str) else value)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` reports of a request (vLLM's ``RequestOutputKind``). `LLM`
    returns whole results, so its calls run every request as ``FINAL_ONLY``."""

    CUMULATIVE = 0  # after every step that adds tokens: everything generated so far
    DELTA = 1  # after every step that adds tokens: only what that step added
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Every field keeps the name, default and meaning of ``vllm.SamplingParams``.

    Args:
        n: Number of completions to return for the prompt.
        presence_penalty: Subtracted from the logit of every token that already appears
            in the generated text. Range [-2, 2].
        frequency_penalty: Subtracted from a token's logit once per occurrence in the
            generated text. Range [-2, 2].
        repetition_penalty: Divides positive (multiplies negative) logits of tokens that
            appear in the prompt or the generated text. Must be > 0; 1 disables it.
        temperature: Softmax temperature; 0 means greedy decoding.
        top_p: Keep the smallest set of most likely tokens whose probability mass reaches
            ``top_p``. Range (0, 1].
        top_k: Keep the ``top_k`` most likely tokens; 0 or -1 disables it (and stays as
            given, as in vLLM; greedy sampling sets it to 0).
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely
            token's. Range [0, 1].
        seed: Seed for this request's random draws. The same seed gives the same tokens
            whatever else runs in the batch.
        stop: Strings that end the completion when generated; not part of the text
            unless ``include_stop_str_in_output``.
        stop_token_ids: Token ids that end the completion; the token stays in
            ``token_ids``.
        bad_words: Words that are never generated (as token sequences).
        include_stop_str_in_output: Keep the matched stop string in the text.
        ignore_eos: Keep generating after the end-of-sequence token.
        max_tokens: Maximum number of generated tokens per completion; None means up to
            the model's context length.
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist.
        logprobs: Number of most likely tokens to report log probabilities for at each
            generated position (the sampled token is always included); -1 means the
            whole vocabulary.
        prompt_logprobs: Same, for every prompt token.
        prompt_logprobs_start: Score only the prompt tokens from this position on (not a
            field of vLLM's): the earlier positions' ``prompt_logprobs`` entries are None,
            and the prefix cache may serve them, as it cannot serve positions that are
            scored. lm-eval's loglikelihood scores a continuation after a shared context
            this way.
        detokenize: Produce ``text``; False returns token ids only (stop strings then
            cannot be used).
        skip_special_tokens: Drop special tokens from the text.
        spaces_between_special_tokens: Put spaces between special tokens in the text.
        logit_bias: Token id to a bias added to its logit, in [-100, 100].
        allowed_token_ids: When given, only these tokens can be generated.
        structured_outputs: Constrain the completion to a JSON schema, a regex, a list of
            choices or a grammar (needs the ``structured`` extra, xgrammar). The completion
            ends with finish_reason "stop" when the grammar is complete and the model ends
            it; when max_tokens cuts it first it ends with "length" and its text may be
            incomplete. Logprobs are then those of the grammar-masked distribution.
        extra_args: Anything else the caller wants to carry with the request; paged_llm
            does not read it, custom logits processors do (``LLM(logits_processors=...)``).
        logits_processors: vLLM 0's per-request logits processors: callables
            ``fn(output_token_ids, logits_row)`` or ``fn(prompt_token_ids,
            output_token_ids, logits_row)`` that return the row's float32 logits (changed
            in place or new), applied in order to this request's rows only, before the
            penalties (see docs/usage.md, "Custom logits processors"). With
            ``data_parallel_size`` > 1 the params travel to a replica process, so the
            callables must pickle (module-level functions, not lambdas or closures).
        output_kind: What `LLMEngine.step` reports of the request: everything so far
            after each step (``CUMULATIVE``), only each step's new tokens and text
            (``DELTA``), or one output when it finishes (``FINAL_ONLY``). `LLM` runs every
            request as ``FINAL_ONLY``.

    Invalid values raise `VLLMValidationError` (a ValueError) naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: _StopStrings = _StopStrings()
    stop_token_ids: _ListField[int] = _ListField()
    bad_words: _ListField[str] = _ListField()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logits_processors: list[Callable[..., Any]] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.verify()
        if self.is_greedy:
            # Filters do not change an argmax; dropping them keeps greedy rows on the fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        """Whether tokens are chosen by argmax rather than drawn."""
        return self.temperature < _GREEDY_EPS

    def verify(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        # NOTE: first, so the range checks below compare finite numbers only (inf and nan
        # pass some of them, None fails them with a bare TypeError).
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(_is_finite(value), name, value, "a finite number")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "a bool")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        # As vLLM: greedy completions would all be the same.
        _check(not (self.is_greedy and self.n > 1), "n", self.n, "1 when using greedy sampling")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "an integer >= 1, or 0 / -1 to disable",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int or None")
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "an integer >= 1, or None for up to max_model_len",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "an integer >= 0",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens={self.max_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= -1),
                name,
                value,
                "None, an integer >= 0, or -1 for the whole vocabulary",
            )
        _check(
            _is_int(self.prompt_logprobs_start)
            and self.prompt_logprobs_start >= 0
            and (self.prompt_logprobs is not None or self.prompt_logprobs_start == 0),
            "prompt_logprobs_start",
            self.prompt_logprobs_start,
            "an integer >= 0, and 0 unless prompt_logprobs is set",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "non-empty strings",
        )
        _check(
            self.detokenize or not self.stop,
            "stop",
            self.stop,
            "empty when detokenize=False (stop strings need text)",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative token ids",
        )
        _check(
            all(isinstance(w, str) and w for w in self.bad_words),
            "bad_words",
            self.bad_words,
            "non-empty strings",
        )
        if self.logit_bias is not None:
            _check(
                all(
                    _is_int(t) and _is_finite(b) and -100.0 <= b <= 100.0
                    for t, b in self.logit_bias.items()
                ),
                "logit_bias",
                self.logit_bias,
                "token ids mapped to biases in [-100, 100]",
            )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                self.allowed_token_ids,
                "a non-empty list of token ids",
            )

        _check_structured_outputs(self.structured_outputs)
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            self.output_kind,
            "a RequestOutputKind",
        )
        _check(
            self.logits_processors is None
            or (
                isinstance(self.logits_processors, list)
                and all(callable(fn) for fn in self.logits_processors)
            ),
            "logits_processors",
            self.logits_processors,
            "None or a list of callables fn(output_token_ids, logits_row) -> logits_row",
        )

    def clone(self) -> SamplingParams:
        """A deep copy, to change without touching this one (vLLM's ``clone``)."""
        return copy.deepcopy(self)

    def token_ids_in_use(self) -> list[int]:
        """Token ids named by the parameters, to be checked against the vocabulary."""
        ids = list(self.stop_token_ids)
        ids.extend(self.logit_bias or ())
        ids.extend(self.allowed_token_ids or ())
        return ids


def _check(ok: bool, name: str, value: object, allowed: str, owner: str = "SamplingParams") -> None:
    if not ok:
        raise VLLMValidationError(
            f"{owner}.{name} must be {allowed}, got {value!r}.", parameter=name, value=value
        )


def _check_structured_outputs(structured_outputs: object, owner: str = "SamplingParams") -> None:
    _check(
        structured_outputs is None or isinstance(structured_outputs, StructuredOutputsParams),
        "structured_outputs",
        structured_outputs,
        "a StructuredOutputsParams or None",
        owner,
    )
    if isinstance(structured_outputs, StructuredOutputsParams):
        structured_outputs.verify()


@dataclass
class BeamSearchParams:
    """How to beam-search the completions of one prompt (`LLM.beam_search`).

    Every field keeps the name, default and meaning of ``vllm.BeamSearchParams``; the
    search itself is described in docs/usage.md ("Beam search").

    Args:
        beam_width: Beams kept after every step, and sequences returned per prompt.
        max_tokens: Most tokens generated per beam (fewer where ``max_model_len`` ends the
            sequence first).
        ignore_eos: Treat EOS as an ordinary token: no beam completes before
            ``max_tokens``.
        temperature: 0 makes each beam offer its ``2 * beam_width`` most likely next
            tokens; above 0 one token drawn at this temperature joins them. Scores are
            always of the model's unscaled distribution.
        length_penalty: Exponent of the length in a beam's score,
            ``cum_logprob / len ** length_penalty``: larger values favour longer
            sequences, 0 ranks by ``cum_logprob`` alone.
        include_stop_str_in_output: Keep the text of the EOS token at the end of the
            ``text`` of a beam that ended with it.
        structured_outputs: Constrain every beam to a grammar, as
            `SamplingParams.structured_outputs` does a sample (not a field of vLLM's, whose
            beam search has no constraints): the candidates are the tokens the grammar
            allows, scored by the distribution it leaves, and a beam whose grammar is
            complete ends on EOS also under ``ignore_eos``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.verify()

    @property
    def n(self) -> int:
        """Sequences returned per prompt (the name `SamplingParams` gives that number)."""
        return self.beam_width

    def verify(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        owner = "BeamSearchParams"
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, value, "an integer >= 1", owner)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "a bool", owner)
        _check(
            _is_finite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            self.temperature,
            "a finite number >= 0",
            owner,
        )
        _check(
            _is_finite(self.length_penalty),
            "length_penalty",
            self.length_penalty,
            "a finite number",
            owner,
        )
        _check_structured_outputs(self.structured_outputs, owner)


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, not a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
