"""Request intake, written once: prompts in every form `LLM.generate` takes, with their
params, become validated `EngineRequest`s, or the `RequestError` saying why one cannot run.

Every entry point (`LLM.generate`, `chat`, `beam_search`, the JSONL and OpenAI batch jobs,
Ray Data, lm-eval) comes through `InputProcessor.process`: it tokenizes text prompts in one
batched call, checks each prompt against the model (non-empty, within max_model_len, ids
in the vocabulary) and each request's params against the engine (n within max_num_seqs,
logprobs within max_logprobs, a tokenizer for stop strings and bad words, a grammar that
parses, the custom logits processors' `validate_params`, a LoRA adapter that the engine can
serve), and tokenizes bad words. A new request field is validated here, once.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from paged_llm.config import EngineConfig
from paged_llm.engine.request import EngineRequest
from paged_llm.exceptions import RequestError, VLLMValidationError
from paged_llm.frontend.lora_requests import LoRARequestChecker, lora_per_prompt
from paged_llm.frontend.model_info import ModelInfo
from paged_llm.frontend.pooling_requests import check_runner, resolve_pooling_params
from paged_llm.inputs import LoRARequest, PromptType
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.structured_outputs.params import StructuredOutputsParams
from paged_llm.structured_outputs.xgrammar_backend import build_grammar

# Why bytes are refused: iterating them gives ints, not prompts.
_BYTES_HINT = "; decode bytes to a str first (e.g. data.decode('utf-8'))."


@dataclass(frozen=True, slots=True)
class RejectedRequest:
    """A request of a call that cannot run: what is known of its prompt, and why."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    error: RequestError


# One entry per prompt of a call, in input order.
ProcessedRequest = EngineRequest | RejectedRequest


def prompt_list(prompts: PromptType | SequenceABC[PromptType]) -> list[Any]:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        hint = _BYTES_HINT if isinstance(prompts, (bytes, bytearray)) else "."
        raise ValueError(
            "prompts must be a str, a {'prompt': ...} or {'prompt_token_ids': [...]} dict, "
            f"or a list of them, got {type(prompts).__name__}" + hint
        )
    return list(prompts)


def params_per_prompt(
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
    num_prompts: int,
    default: SamplingParams,
) -> list[SamplingParams]:
    """One SamplingParams per prompt: ``default`` for None, one given for all, or the list."""
    if sampling_params is None:
        return [default] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(
            "sampling_params must be a SamplingParams, a list with one per prompt, or "
            f"None, got {type(sampling_params).__name__}; build it with "
            "SamplingParams(**fields)."
        )
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"Got {len(params)} SamplingParams for {num_prompts} prompts; pass one "
            "SamplingParams for all prompts or a list with exactly one per prompt."
        )
    return params


@dataclass
class _Prompt:
    """One prompt on its way through `InputProcessor.process`."""

    index: int
    request_id: str
    text: str | None
    token_ids: list[int] = field(default_factory=list)


class InputProcessor:
    """Validates requests against one model and engine configuration."""

    def __init__(self, model: ModelInfo, config: EngineConfig) -> None:
        self.tokenizer: PreTrainedTokenizerBase | None = model.tokenizer
        self.vocab_size = model.vocab_size
        self.eos_token_ids = model.eos_token_ids
        self.config = config
        self._request_ids = itertools.count()
        self._lora_checker = LoRARequestChecker(config)

    def process(
        self,
        prompts: list[Any],
        params: SequenceABC[object],
        *,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_requests: SequenceABC[LoRARequest | None] | None = None,
    ) -> list[ProcessedRequest]:
        """Each prompt with its `SamplingParams` (and adapter, from ``lora_requests``) as an
        `EngineRequest`, or as a `RejectedRequest` whose `RequestError` names its index, the
        parameter at fault and the reason."""
        check_runner(self.config, pooling=False, call="generate")
        return self._process(
            prompts, params, self._sampling_request, priority, tokenization_kwargs, lora_requests
        )

    def process_pooling(
        self,
        prompts: list[Any],
        params: SequenceABC[object],
        task: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        lora_requests: SequenceABC[LoRARequest | None] | None = None,
    ) -> list[ProcessedRequest]:
        """Each prompt with its `PoolingParams` as a pooling request for ``task`` (a task
        the engine's pooler serves: `pooling_requests.check_task`), or as a
        `RejectedRequest`."""

        def make_request(
            prompt: _Prompt, request_params: object, lora_request: LoRARequest | None
        ) -> EngineRequest:
            resolved, prompt.token_ids = resolve_pooling_params(
                self.config, request_params, task, prompt.token_ids
            )
            self._check_prompt(prompt.token_ids, room=0)
            return EngineRequest(
                prompt.request_id,
                prompt.text,
                prompt.token_ids,
                resolved,
                lora_request=lora_request,
            )

        check_runner(self.config, pooling=True, call=task)
        return self._process(
            prompts, params, make_request, None, tokenization_kwargs, lora_requests
        )

    def process_beam_search(
        self,
        prompts: list[Any],
        params: BeamSearchParams,
        lora_requests: SequenceABC[LoRARequest | None] | None = None,
    ) -> list[ProcessedRequest]:
        """Each prompt as a beam search with ``params`` (checked once, by
        `check_beam_search`), or as a `RejectedRequest`."""
        check_runner(self.config, pooling=False, call="beam_search")
        return self._process(
            prompts, [params] * len(prompts), self._beam_search_request, None, None, lora_requests
        )

    def _process(
        self,
        prompts: list[Any],
        params: SequenceABC[object],
        make_request: Callable[[_Prompt, Any, LoRARequest | None], EngineRequest],
        priority: list[int] | None,
        tokenization_kwargs: dict[str, Any] | None,
        lora_requests: SequenceABC[LoRARequest | None] | None,
    ) -> list[ProcessedRequest]:
        priorities = _priorities(priority, len(prompts))
        loras = lora_per_prompt(lora_requests, len(prompts))
        if tokenization_kwargs is not None and not isinstance(tokenization_kwargs, dict):
            raise ValueError(
                "tokenization_kwargs must be a dict of tokenizer arguments or None, got "
                f"{type(tokenization_kwargs).__name__}."
            )
        texts = {
            index: text
            for index, prompt in enumerate(prompts)
            if (text := prompt_text(prompt)) is not None
        }
        encoded = self._encode(texts, tokenization_kwargs or {})
        processed: list[ProcessedRequest] = []
        for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
            entry = _Prompt(index, str(next(self._request_ids)), texts.get(index))
            try:
                if index in texts:
                    result = encoded[index]
                    if isinstance(result, RequestError):
                        raise result
                    entry.token_ids = result
                else:
                    entry.text, entry.token_ids = _prompt_tokens(prompt)
                if priorities[index] != 0:
                    raise RequestError(
                        f"priority={priorities[index]}, but requests run first come, first "
                        "served here (scheduling_policy 'fcfs' only); pass priority 0 or None.",
                        parameter="priority",
                        value=priorities[index],
                    )
                self._lora_checker.check(loras[index])
                processed.append(make_request(entry, request_params, loras[index]))
            except ValueError as error:
                processed.append(
                    RejectedRequest(
                        entry.request_id, entry.text, entry.token_ids, RequestError.of(error, index)
                    )
                )
        return processed

    def _encode(
        self, texts: dict[int, str], tokenization_kwargs: dict[str, Any]
    ) -> dict[int, list[int] | RequestError]:
        """The token ids of each text prompt, in one batched tokenizer call, or why it has
        none: a text that is not valid Unicode (a lone surrogate) would fail the batched
        call for every prompt, so it is that request's error alone; so is a missing
        tokenizer."""
        encoded: dict[int, list[int] | RequestError] = {}
        for index, text in texts.items():
            if self.tokenizer is None:
                encoded[index] = RequestError(
                    "a text prompt needs a tokenizer, and this LLM was built with "
                    "skip_tokenizer_init=True; pass {'prompt_token_ids': [...]} instead.",
                    parameter="prompt",
                )
            elif (error := _unicode_error(text, "prompt")) is not None:
                encoded[index] = RequestError(error, parameter="prompt")
        encodable = [index for index in texts if index not in encoded]
        if encodable:
            assert self.tokenizer is not None
            batch = self.tokenizer([texts[i] for i in encodable], **tokenization_kwargs)
            encoded.update(
                (index, list(ids)) for index, ids in zip(encodable, batch["input_ids"], strict=True)
            )
        return encoded

    def _sampling_request(
        self, prompt: _Prompt, params: object, lora_request: LoRARequest | None
    ) -> EngineRequest:
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}.",
                parameter="sampling_params",
            )
        self._check_prompt(prompt.token_ids)
        self._check_sampling_params(params, len(prompt.token_ids))
        self._check_logits_processors(params)
        bad_words_token_ids = self._bad_words_token_ids(params)
        self._check_allowed_token_ids(params, bad_words_token_ids)
        return EngineRequest(
            prompt.request_id,
            prompt.text,
            prompt.token_ids,
            params,
            bad_words_token_ids,
            lora_request=lora_request,
        )

    def _beam_search_request(
        self, prompt: _Prompt, params: BeamSearchParams, lora_request: LoRARequest | None
    ) -> EngineRequest:
        self._check_prompt(prompt.token_ids)
        return EngineRequest(
            prompt.request_id,
            prompt.text,
            prompt.token_ids,
            params,
            lora_request=lora_request,
        )

    def _check_prompt(self, token_ids: list[int], room: int = 1) -> None:
        """A prompt runs when it has at least one token, leaves ``room`` for generated
        tokens within max_model_len (none for a pooling request), and names only ids of the
        vocabulary."""
        max_model_len = self.config.max_model_len
        if not token_ids:
            raise RequestError(
                "the prompt is empty (0 tokens); every request needs at least one prompt token.",
                parameter="prompt",
            )
        if len(token_ids) + room > max_model_len:
            room_for = (
                f"{max_model_len - 1} prompt tokens plus 1 generated token"
                if room
                else f"{max_model_len} prompt tokens (or truncate_prompt_tokens keeps the last "
                "ones)"
            )
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len={max_model_len} "
                f"leaves room for at most {room_for}. Shorten the prompt, or raise "
                "max_model_len (up to the model's "
                f"max_position_embeddings={self.config.hf_config.max_position_embeddings}).",
                parameter="prompt",
                value=len(token_ids),
            )
        bad = self._outside_vocabulary(token_ids)
        if bad is not None:
            raise RequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size}).",
                parameter="prompt_token_ids",
                value=bad,
            )

    def _outside_vocabulary(self, token_ids: list[int]) -> int | None:
        """The first of ``token_ids`` the model cannot produce, or None."""
        return next((t for t in token_ids if not 0 <= t < self.vocab_size), None)

    def _check_sampling_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        try:
            params.verify()
        except VLLMValidationError:
            raise
        except ValueError as error:  # StructuredOutputsParams' own checks
            raise RequestError(str(error), parameter="structured_outputs") from None
        if params.prompt_logprobs_start >= num_prompt_tokens:
            raise RequestError(
                f"prompt_logprobs_start={params.prompt_logprobs_start} is past the prompt's "
                f"last position, {num_prompt_tokens - 1}; score from a position inside the "
                "prompt.",
                parameter="prompt_logprobs_start",
                value=params.prompt_logprobs_start,
            )
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise RequestError(
                "stop strings and bad_words need a tokenizer, and this LLM was built with "
                "skip_tokenizer_init=True; use stop_token_ids instead.",
                parameter="stop" if params.stop else "bad_words",
            )
        max_num_seqs = self.config.scheduler.max_num_seqs
        if params.n > max_num_seqs:
            raise RequestError(
                f"n={params.n} exceeds max_num_seqs={max_num_seqs}; the n sequences of a "
                "request run together. Lower n or raise max_num_seqs.",
                parameter="n",
                value=params.n,
            )
        bad = self._outside_vocabulary(params.token_ids_in_use())
        if bad is not None:
            raise RequestError(
                f"SamplingParams names token id {bad}, outside the vocabulary "
                f"[0, {self.vocab_size}).",
                parameter="token_ids",
                value=bad,
            )
        self._check_logprobs(params)

    def _check_logits_processors(self, params: SamplingParams) -> None:
        """Each custom logits processor's `validate_params`: what it raises refuses this
        request, naming the processor."""
        for processor in self.config.logits_processors:
            try:
                processor.validate_params(params)
            except Exception as error:  # a user's check may raise anything
                parameter = getattr(error, "parameter", None) or (
                    "extra_args" if params.extra_args else "logits_processors"
                )
                raise RequestError(
                    f"logits processor {processor.__name__} refused the request: "
                    f"{type(error).__name__}: {error}",
                    parameter=parameter,
                    value=getattr(error, "value", None),
                ) from error

    def _check_allowed_token_ids(
        self, params: SamplingParams, bad_words_token_ids: list[list[int]]
    ) -> None:
        """Refuse allowed_token_ids that the bans leave empty: every allowed id a one-token
        bad word, or, before min_tokens, every allowed id also an EOS (unless ignore_eos)
        or stop token id, which min_tokens holds back. Such a request could generate no
        token at all."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        never = {ids[0] for ids in bad_words_token_ids if len(ids) == 1}
        if allowed <= never:
            raise RequestError(
                f"allowed_token_ids={params.allowed_token_ids} are all bad_words, so no token "
                "can be generated; allow a token that is no bad word, or drop those bad words.",
                parameter="allowed_token_ids",
                value=params.allowed_token_ids,
            )
        held_back = set(params.stop_token_ids)
        if not params.ignore_eos:
            held_back |= self.eos_token_ids
        if params.min_tokens > 0 and allowed <= never | held_back:
            raise RequestError(
                f"allowed_token_ids={params.allowed_token_ids} holds only EOS and stop token "
                f"ids{' and bad words' if allowed & never else ''}, and min_tokens="
                f"{params.min_tokens} holds EOS and stop tokens back until {params.min_tokens} "
                "tokens exist, so no first token is allowed; allow another token, or set "
                "min_tokens=0 (or ignore_eos=True where the ids are EOS).",
                parameter="allowed_token_ids",
                value=params.allowed_token_ids,
            )

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's cap: -1 asks for the whole vocabulary, allowed only with max_logprobs=-1;
        never more than the vocabulary."""
        max_logprobs = self.config.max_logprobs
        limit = self.vocab_size if max_logprobs == -1 else min(max_logprobs, self.vocab_size)
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            requested = getattr(params, name)
            if requested is None:
                continue
            if requested == -1:
                requested = self.vocab_size
            if requested > limit:
                raise RequestError(
                    f"Requested {kind} logprobs of {requested}, which is greater than max "
                    f"allowed: {limit} (the vocabulary has {self.vocab_size} tokens, "
                    f"LLM(max_logprobs={max_logprobs})). Lower {name}, or raise max_logprobs "
                    "(-1 allows the whole vocabulary).",
                    parameter=name,
                    value=requested,
                )

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """Parse the constraint now, so that a bad schema or regex fails its own request up
        front; the engine compiles it for the tokenizer beside the running batch."""
        if self.tokenizer is None:
            raise VLLMValidationError(
                "structured outputs compile their grammar for the tokenizer, and this LLM was "
                "built with skip_tokenizer_init=True; build it with a tokenizer.",
                parameter="structured_outputs",
            )
        try:
            build_grammar(structured_outputs)
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter="structured_outputs") from None

    def check_beam_search(self, params: object) -> BeamSearchParams:
        """The params of a `LLM.beam_search` call, checked once for all its prompts."""
        if not isinstance(params, BeamSearchParams):
            raise VLLMValidationError(
                f"params must be a BeamSearchParams, got {type(params).__name__}; build it "
                "with BeamSearchParams(beam_width=..., max_tokens=...).",
                parameter="params",
            )
        params.verify()
        if self.tokenizer is None:
            raise VLLMValidationError(
                "Beam search decodes the text of its sequences, and this LLM was built with "
                "skip_tokenizer_init=True; build it with a tokenizer.",
                parameter="skip_tokenizer_init",
            )
        max_num_seqs = self.config.scheduler.max_num_seqs
        if params.beam_width > max_num_seqs:
            raise VLLMValidationError(
                f"BeamSearchParams.beam_width={params.beam_width} exceeds max_num_seqs="
                f"{max_num_seqs}; the beams of a prompt run together. Lower beam_width or "
                "raise max_num_seqs.",
                parameter="beam_width",
                value=params.beam_width,
            )
        if 2 * params.beam_width > self.vocab_size:
            raise VLLMValidationError(
                f"BeamSearchParams.beam_width={params.beam_width} needs 2 * beam_width "
                f"candidate tokens per beam, more than the vocabulary's {self.vocab_size}.",
                parameter="beam_width",
                value=params.beam_width,
            )
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)
        return params

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token sequences of each bad word, at the start of a text and after a space, all
        within the model's vocabulary (a tokenizer may have added tokens past it)."""
        sequences: list[list[int]] = []
        if not params.bad_words:
            return sequences
        assert self.tokenizer is not None  # checked with the params
        for word in params.bad_words:
            error = _unicode_error(word, "bad word")
            if error is not None:
                raise RequestError(error, parameter="bad_words", value=word)
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise RequestError(
                    f"bad word {word!r} is no tokens once leading spaces are dropped; remove "
                    "it from bad_words.",
                    parameter="bad_words",
                    value=word,
                )
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            forms = [bare]
            # The spaced form counts only when it is another word of the same length, as
            # vLLM decides.
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                forms.append(spaced)
            outside = self._outside_vocabulary([t for ids in forms for t in ids])
            if outside is not None:
                raise RequestError(
                    f"bad word {word!r} has token id {outside}, outside the model's vocabulary "
                    f"[0, {self.vocab_size}): the tokenizer ({len(self.tokenizer)} tokens) has "
                    "tokens the model cannot produce; remove the word from bad_words.",
                    parameter="bad_words",
                    value=word,
                )
            sequences.extend(forms)
        return sequences


def prompt_text(prompt: Any) -> str | None:
    """The text of a prompt given as text: a str, or a `TextPrompt` without token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


def _prompt_tokens(prompt: Any) -> tuple[str | None, list[int]]:
    """The text and token ids of a prompt given as a dict."""
    if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
        raise RequestError(
            "a prompt must be a str, a {'prompt': str} dict or a dict with "
            f"'prompt_token_ids', got {type(prompt).__name__}"
            + (f" with keys {sorted(prompt)}." if isinstance(prompt, dict) else "."),
            parameter="prompt",
        )
    token_ids = prompt["prompt_token_ids"]
    if isinstance(token_ids, (str, bytes, bytearray, dict)) or not isinstance(token_ids, Iterable):
        raise RequestError(
            f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}.",
            parameter="prompt_token_ids",
        )
    ids = list(token_ids)
    # Any integer type (numpy's included) is a token id; a bool is not.
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise RequestError(
            f"prompt_token_ids must be a list of ints, got an element {bad!r} of type "
            f"{type(bad).__name__}.",
            parameter="prompt_token_ids",
            value=bad,
        )
    return prompt.get("prompt"), [int(t) for t in ids]


def _unicode_error(text: str, what: str) -> str | None:
    """Why ``text`` cannot be tokenized (it is not valid Unicode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"the {what} is not valid Unicode text: {text[error.start : error.end]!r} at "
            f"position {error.start} is a lone surrogate; decode the source with "
            "errors='replace' or drop that character."
        )
    return None


def _priorities(priority: list[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise ValueError(
            f"priority must be None or a list with one int per prompt ({num_prompts}), got "
            f"{priority!r}."
        )
    return list(priority)
