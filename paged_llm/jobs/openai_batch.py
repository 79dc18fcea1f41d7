"""OpenAI Batch API files (``paged-llm run-batch``): request lines into prompts and
SamplingParams, results into response lines, as OpenAI's Batch API and ``vllm run-batch``
write them.

Input lines are ``{"custom_id", "method": "POST", "url", "body"}`` with the url
``/v1/chat/completions``, ``/v1/completions`` or ``/v1/embeddings`` (run by a pooling model,
`paged_llm.jobs.openai_embeddings`). Output lines are
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``: a
``chat.completion``, ``text_completion`` or embeddings ``list`` object with status 200, or for
a request that cannot run an OpenAI error body with status 400 and ``error`` set to the same
message.

A body's ``"model"`` chooses what runs it, as ``vllm serve --lora-modules NAME=PATH`` does: a
registered LoRA adapter's name runs the request under that adapter; one of the served
model's names (`served_model_names`), or no ``"model"``, runs the base model; any other name
is the line's error (`paged_llm.jobs.lora_modules`).

A request's ids are derived from its custom_id (from its line number when it has no usable
one), never drawn at random, so a resumed job writes the same line an uninterrupted one would
(only ``created``, the time it finished, differs).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_llm.exceptions import ConversationError, RequestError
from paged_llm.frontend.chat import check_conversation
from paged_llm.inputs import TokensPrompt
from paged_llm.jobs.requests import sampling_params_over
from paged_llm.jobs.rows import decode_line, messages_problem, parse_json
from paged_llm.outputs import Logprob, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_outputs import StructuredOutputsParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
# How an embedding is written: a list of floats, or OpenAI's base64 of little-endian float32.
ENCODING_FORMATS = ("float", "base64")
# OpenAI's default length for a text completion; a chat completion runs up to the context.
_DEFAULT_COMPLETION_MAX_TOKENS = 16

# Body fields that change nothing here: OpenAI bookkeeping, or options that only have a
# meaning on a server.
_IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
)
# Body fields that are SamplingParams fields of the same name and meaning (vLLM's extra
# sampling fields included, so that vllm run-batch files run unchanged).
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
_CHAT_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "logit_bias", "logprobs"}
    | {"top_logprobs", "response_format", "stream"}
)
_COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "logit_bias", "logprobs", "echo", "best_of", "suffix"}
    | {"response_format", "stream"}
)
# OpenAI's embeddings fields, and vLLM's truncate_prompt_tokens (keep the last k tokens).
_EMBEDDING_FIELDS = frozenset(
    {"model", "input", "dimensions", "encoding_format", "truncate_prompt_tokens"}
)


@dataclass(slots=True)
class BatchRequest:
    """One input line; ``line`` is 1-based. ``error`` set means the line gets an error
    response instead of running."""

    line: int
    custom_id: str | None
    url: str
    body: dict[str, Any]
    # Why the line cannot run (it gets an error line), or None.
    error: RequestError | None = None
    # Whether this line is the first with its custom_id (so the custom_id names its output).
    owns_custom_id: bool = False

    @property
    def key(self) -> str:
        """The output line's ``id``, the key ``--resume`` skips finished requests by."""
        return "batch_req_" + self.digest

    @property
    def digest(self) -> str:
        """A hex name of the request, the same in every run: the root of its ids."""
        # NOTE: a line without a custom_id of its own (malformed, or a duplicate) is named by
        # its line number, so it cannot take the id of the custom_id it repeats.
        name = ["custom_id", self.custom_id] if self.owns_custom_id else ["line", self.line]
        return hashlib.blake2b(json.dumps(name).encode(), digest_size=12).hexdigest()

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL

    @property
    def is_embeddings(self) -> bool:
        """An embeddings request (a pooling model's); otherwise a generation, or a bad line."""
        return self.error is None and self.url == EMBEDDINGS_URL


def read_requests(path: Path) -> list[BatchRequest]:
    """Every non-blank line of a batch input file, bad ones with ``error`` set."""
    first_line_of: dict[str, int] = {}
    with open(path, "rb") as lines:
        return [
            parse_line(number, raw, first_line_of)
            for number, raw in enumerate(lines, start=1)
            if raw.strip()
        ]


def parse_line(line: int, raw: bytes, first_line_of: dict[str, int]) -> BatchRequest:
    """One input line as a request; a bad line comes back with ``error`` set, never raises.

    ``first_line_of`` maps the custom_ids seen so far to their lines, and gains this one's.
    """
    request = BatchRequest(line, None, "", {})
    try:
        record = parse_json(decode_line(raw))
    except ValueError as error:
        request.error = RequestError(str(error))
        return request
    try:
        checked = _check_line(line, record, first_line_of)
    except RequestError as error:
        request.error = error
        if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
            request.custom_id = record["custom_id"]
        return request
    request.custom_id, request.url, request.body = (
        checked["custom_id"],
        checked["url"],
        checked["body"],
    )
    first_line_of[request.custom_id] = line
    request.owns_custom_id = True
    try:
        _check_body(request)
    except RequestError as error:
        request.error = error
    return request


def _check_line(line: int, record: object, first_line_of: dict[str, int]) -> dict[str, Any]:
    """The line's record once its fields are checked; RequestError says which is wrong."""
    if not isinstance(record, dict):
        raise RequestError(f"expected a JSON object, got {type(record).__name__}")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestError("'custom_id' must be a non-empty string")
    if custom_id in first_line_of:
        raise RequestError(
            f"duplicate custom_id {custom_id!r} (first seen on line "
            f"{first_line_of[custom_id]}); each request needs its own"
        )
    if record.get("method", "POST") != "POST":
        raise RequestError(f"'method' must be \"POST\", got {record['method']!r}")
    url = record.get("url")
    if url not in URLS:
        raise RequestError(
            f"unsupported url {url!r}; supported: {', '.join(URLS)}", parameter="url"
        )
    if not isinstance(record.get("body"), dict):
        raise RequestError("'body' must be a JSON object", parameter="body")
    return record


def _check_body(request: BatchRequest) -> None:
    """The body's fields and JSON types; value ranges are SamplingParams' to check."""
    body = request.body
    allowed = (
        _EMBEDDING_FIELDS
        if request.url == EMBEDDINGS_URL
        else (_CHAT_FIELDS if request.is_chat else _COMPLETION_FIELDS) | set(_SAMPLING_FIELDS)
    )
    unknown = sorted(set(body) - allowed - _IGNORED_FIELDS)
    if unknown:
        raise RequestError(
            f"unknown body field(s) {', '.join(map(repr, unknown))} for {request.url}",
            parameter=unknown[0],
        )
    if request.url == EMBEDDINGS_URL:
        embedding_inputs(request)
        encoding = body.get("encoding_format", "float")
        if encoding not in ENCODING_FORMATS:
            raise RequestError(
                f"'encoding_format' must be one of {', '.join(map(repr, ENCODING_FORMATS))}, "
                f"got {encoding!r}",
                parameter="encoding_format",
            )
        return
    if body.get("stream"):
        raise RequestError("'stream' must be false in a batch file", parameter="stream")
    try:
        StructuredOutputsParams.from_response_format(body.get("response_format"))
    except ValueError as error:
        raise RequestError(str(error), parameter="response_format") from None
    if request.is_chat:
        _check_messages(body.get("messages"))
    else:
        _check_completion_body(body)


def _check_messages(messages: object) -> None:
    try:
        check_conversation(messages)
    except ConversationError as error:
        raise RequestError(messages_problem(error), parameter="messages") from None


def _check_completion_body(body: dict[str, Any]) -> None:
    prompt = _single_prompt(body)
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and _all_token_ids(prompt))):
        raise RequestError(
            "'prompt' must be one string or one list of token ids (one prompt per line: split "
            "a list of prompts into lines of their own)",
            parameter="prompt",
        )
    if body.get("suffix") is not None:
        raise RequestError("'suffix' (insertion) is not supported", parameter="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise RequestError("'best_of' is not supported unless it equals 'n'", parameter="best_of")
    if body.get("echo") and body.get("logprobs") is not None:
        raise RequestError("'echo' with 'logprobs' is not supported", parameter="echo")
    if body.get("echo") and not isinstance(prompt, str):
        raise RequestError("'echo' needs a text prompt, not token ids", parameter="echo")


def _single_prompt(body: dict[str, Any]) -> object:
    """The body's prompt, unwrapped from a list of one prompt (as clients often send it)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def _all_token_ids(values: list[Any]) -> bool:
    return bool(values) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values
    )


def embedding_inputs(request: BatchRequest) -> list[str | TokensPrompt]:
    """The prompts of an embeddings body's ``"input"`` (a string, a list of strings, a list
    of token ids, or a list of such lists), one embedding each; a `RequestError` (parameter
    ``input``) for any other value."""
    value = request.body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if _all_token_ids(value):
            return [TokensPrompt(prompt_token_ids=[int(t) for t in value])]
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) and _all_token_ids(item) for item in value):
            return [TokensPrompt(prompt_token_ids=[int(t) for t in item]) for item in value]
    raise RequestError(
        "'input' must be a string, a non-empty list of strings, a non-empty list of token "
        "ids, or a list of such lists",
        parameter="input",
    )


def served_model_names(model: str, served_model_name: str | list[str] | None) -> list[str]:
    """The names a body's ``"model"`` may give the base model: every ``--served-model-name``
    (vLLM serves the model under each), else ``--model``; the first is the one responses
    report."""
    if served_model_name is None:
        return [model]
    return [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)


def completion_prompt(request: BatchRequest) -> str | TokensPrompt:
    """A text completion's prompt: its text, or its token ids as a ``{"prompt_token_ids"}``
    prompt."""
    prompt = _single_prompt(request.body)
    if isinstance(prompt, str):
        return prompt
    assert isinstance(prompt, list)  # checked by parse_line
    return TokensPrompt(prompt_token_ids=[int(t) for t in prompt])


def sampling_params(
    request: BatchRequest, defaults: SamplingParams, model_max_tokens: int | None
) -> SamplingParams:
    """The request's SamplingParams: the body's fields over ``defaults`` (the model's
    generation_config). Without max_tokens in the body, a completion is as long as
    ``model_max_tokens`` (the model's max_new_tokens) allows, else 16 tokens for a text
    completion and up to the context for a chat one, as OpenAI's API. Raises RequestError
    naming the field whose value is out of range."""
    body = request.body
    fields: dict[str, Any] = {
        name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None
    }
    fields["max_tokens"] = next(
        (
            value
            for value in (body.get("max_completion_tokens"), body.get("max_tokens"))
            if value is not None
        ),
        model_max_tokens or (None if request.is_chat else _DEFAULT_COMPLETION_MAX_TOKENS),
    )
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        fields["logit_bias"] = _logit_bias(logit_bias)
    fields["logprobs"] = num_logprobs(request)
    fields["structured_outputs"] = StructuredOutputsParams.from_response_format(
        body.get("response_format")
    )
    return sampling_params_over(defaults, fields)


def _logit_bias(value: object) -> dict[int, float]:
    # JSON object keys are strings: OpenAI spells token ids as "1234".
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) for k, v in value.items()
    ):
        raise RequestError(
            "'logit_bias' must map token ids (as strings) to numbers in [-100, 100]",
            parameter="logit_bias",
        )
    return {int(token_id): float(bias) for token_id, bias in value.items()}


def num_logprobs(request: BatchRequest) -> int | None:
    """How many top logprobs each generated token reports, or None for no logprobs."""
    body = request.body
    if request.is_chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise RequestError(
                "'logprobs' must be a bool for chat completions", parameter="logprobs"
            )
        if top is not None and not wanted:
            raise RequestError("'top_logprobs' needs 'logprobs': true", parameter="top_logprobs")
        count = top if wanted else None
        if wanted and top is None:
            count = 0
        name = "top_logprobs"
    else:
        count, name = body.get("logprobs"), "logprobs"
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise RequestError(f"'{name}' must be an integer >= 0, got {count!r}", parameter=name)
    return count


def success_line(
    request: BatchRequest, output: RequestOutput, model: str, created: int
) -> dict[str, Any]:
    """The output line of a request that ran: its completion object, status 200."""
    num_top = num_logprobs(request) or 0
    choices = []
    for completion in output.outputs:
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                _chosen_and_top(position, token_id, num_top)
                for position, token_id in zip(
                    completion.logprobs, completion.token_ids, strict=False
                )
            ]
        choice = (
            _chat_choice(completion.text, logprobs)
            if request.is_chat
            else _completion_choice(request, output.prompt, completion.text, logprobs)
        )
        choices.append(
            {
                "index": completion.index,
                **choice,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    completion_tokens = sum(len(completion.token_ids) for completion in output.outputs)
    body = {
        "id": ("chatcmpl-" if request.is_chat else "cmpl-") + request.digest,
        "object": "chat.completion" if request.is_chat else "text_completion",
        "created": created,
        "model": request.body.get("model") or model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(output.prompt_token_ids) + completion_tokens,
        },
    }
    return _line(request, 200, body, None)


def response_line(request: BatchRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a request that ran, with its response ``body``: status 200."""
    return _line(request, 200, body, None)


def error_line(request: BatchRequest, error: RequestError) -> dict[str, Any]:
    """The output line of a request that cannot run: status 400, OpenAI's error body, the
    reason prefixed with the input line it came from, ``param`` the field at fault."""
    message = f"line {request.line}: {error.reason}"
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": error.parameter}
    }
    return _line(request, 400, body, {"code": "invalid_request", "message": message})


def _line(
    request: BatchRequest, status: int, body: dict[str, Any], error: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": request.key,
        "custom_id": request.custom_id,
        "response": {"status_code": status, "request_id": "req_" + request.digest, "body": body},
        "error": error,
    }


# Per generated token: its Logprob and the most likely tokens', best first.
_TokenLogprobs = list[tuple[Logprob, list[Logprob]]]


def _chat_choice(text: str, logprobs: _TokenLogprobs | None) -> dict[str, Any]:
    return {
        "message": {"role": "assistant", "content": text},
        "logprobs": None
        if logprobs is None
        else {
            "content": [
                {**_token_entry(chosen), "top_logprobs": [_token_entry(e) for e in top]}
                for chosen, top in logprobs
            ]
        },
    }


def _completion_choice(
    request: BatchRequest, prompt: str | None, text: str, logprobs: _TokenLogprobs | None
) -> dict[str, Any]:
    echoed = (prompt or "") if request.body.get("echo") else ""
    if logprobs is None:
        return {"text": echoed + text, "logprobs": None}
    tokens = [chosen.decoded_token or "" for chosen, _ in logprobs]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=len(echoed)))
    return {
        "text": echoed + text,
        "logprobs": {
            "tokens": tokens,
            "token_logprobs": [chosen.logprob for chosen, _ in logprobs],
            "top_logprobs": [
                {e.decoded_token or "": e.logprob for e in top} for _, top in logprobs
            ],
            "text_offset": offsets,
        },
    }


def _chosen_and_top(
    position: dict[int, Logprob], token_id: int, num_top: int
) -> tuple[Logprob, list[Logprob]]:
    """The generated token's Logprob and the ``num_top`` most likely, best first.

    NOTE: the dict holds the most likely tokens plus the generated one (its rank may be past
    them); sorting by rank makes the answer independent of the order the dict lists them in.
    """
    ranked = sorted(position.values(), key=lambda entry: entry.rank or 0)
    return position[token_id], ranked[:num_top]


def _token_entry(entry: Logprob) -> dict[str, Any]:
    token = entry.decoded_token or ""
    return {
        "token": token,
        "logprob": entry.logprob,
        "bytes": list(token.encode("utf-8", errors="replace")),
    }
