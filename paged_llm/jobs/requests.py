"""From a job's rows to requests and back: every job kind (JSONL rows, OpenAI batch lines,
Ray Data rows) maps a row to a `JobRequest` (a prompt, its `SamplingParams`, or its
`PoolingParams` for a pooling task, and its LoRA adapter), or to the `RequestError` that
says why it cannot run, and gets each result as it finishes, through these functions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, cast

from paged_llm.exceptions import ConversationError, RequestError
from paged_llm.frontend.input_processor import RejectedRequest
from paged_llm.frontend.pooling import PoolingResult
from paged_llm.frontend.stream import GenerationStream
from paged_llm.inputs import PromptType, TokensPrompt
from paged_llm.llm import LLM
from paged_llm.lora.request import LoRARequest
from paged_llm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import SamplingParams

# A job's task: "generate", or the pooling task (`LLM.encode`'s) its rows run.
GENERATE = "generate"
# The pooling tasks a job runs, by the key of the vector in its output rows.
POOLING_JOB_TASKS = {"embed": "embedding", "classify": "probs"}
# The result of one job request: a generation, a pooling output, or why it did not run.
JobResult = RequestOutput | PoolingRequestOutput[PoolingOutput] | RequestError


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A row ready to run: its prompt, how to sample it (or, for a pooling task, how to pool
    it), and the LoRA adapter it runs under (None: the base model)."""

    prompt: PromptType
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None = None


_SAMPLING_FIELDS = frozenset(field.name for field in fields(SamplingParams))


def sampling_params_over(defaults: SamplingParams, values: Mapping[str, Any]) -> SamplingParams:
    """``defaults`` with ``values`` (by SamplingParams field names) over them; a
    `RequestError` names the field that is unknown or out of range."""
    unknown = sorted(set(values) - _SAMPLING_FIELDS)
    if unknown:
        raise RequestError(
            f"unknown SamplingParams field(s) {', '.join(map(repr, unknown))}",
            parameter=unknown[0],
        )
    try:
        return replace(defaults, **values)
    except TypeError as error:
        raise RequestError(f"invalid sampling parameters: {error}") from None
    except ValueError as error:
        raise RequestError.of(error) from None


def chat_prompt(llm: LLM, messages: object) -> TokensPrompt:
    """A chat row's prompt, rendered with the model's chat template; a `RequestError`
    (parameter ``messages``) says why its messages cannot be."""
    try:
        return llm.chat_renderer.render(messages)
    except ConversationError as error:
        raise RequestError(f"cannot render messages: {error}", parameter="messages") from None


def run_requests(
    llm: LLM,
    requests: Sequence[JobRequest | RequestError],
    *,
    progress: bool,
    task: str = GENERATE,
) -> Iterator[tuple[int, JobResult]]:
    """``(position, output or error)`` for every entry of ``requests``: first the errors
    given, then each request's output (or the reason the engine refused it) as it
    finishes. ``task`` is "generate" (the requests hold `SamplingParams`) or a pooling task
    (`POOLING_JOB_TASKS`; they hold `PoolingParams`). Leaving the loop early cancels the
    requests still running."""
    positions: list[int] = []
    runnable: list[JobRequest] = []
    for position, request in enumerate(requests):
        if isinstance(request, RequestError):
            yield position, request
        else:
            positions.append(position)
            runnable.append(request)
    if not runnable:
        return
    # NOTE: the one place where a job's request fields reach the engine.
    prompts = [request.prompt for request in runnable]
    loras = [request.lora_request for request in runnable]
    stream: GenerationStream[RequestOutput] | GenerationStream[PoolingResult] = (
        llm.generate_stream(
            prompts,
            [cast(SamplingParams, request.params) for request in runnable],
            use_tqdm=progress,
            on_error="skip",
            lora_request=loras,
        )
        if task == GENERATE
        else llm.encode_stream(
            prompts,
            [cast(PoolingParams, request.params) for request in runnable],
            use_tqdm=progress,
            on_error="skip",
            pooling_task=task,
            lora_request=loras,
        )
    )
    with contextlib.closing(stream):
        for index, result in stream.results():
            yield positions[index], result.error if isinstance(result, RejectedRequest) else result
