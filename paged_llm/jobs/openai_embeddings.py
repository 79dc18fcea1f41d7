"""The ``/v1/embeddings`` lines of an OpenAI batch file (``paged-llm run-batch --runner
pooling``): each line's inputs embedded, its response written as OpenAI's embeddings
response once every input of the line is done.

A body is ``{"model", "input": str | list[str] | list[int] | list[list[int]],
"dimensions"?, "encoding_format"?: "float" | "base64", "truncate_prompt_tokens"?}``
(`openai_batch.embedding_inputs`); the response body is ``{"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}``, an embedding being a list of floats or, under ``"base64"``, the base64 of
its little-endian float32 bytes. A line one of whose inputs cannot run gets one error line
naming that input (``input[i]``) and the field at fault.

One `LLM` runs one kind of model: a generating run-batch answers ``/v1/embeddings`` lines,
and a pooling one chat and completion lines, with an error line naming the url and the
``--runner`` that serves it (`wrong_runner`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from paged_llm.exceptions import RequestError, VLLMValidationError
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.jobs.openai_batch import (
    EMBEDDINGS_URL,
    BatchRequest,
    embedding_inputs,
    error_line,
    response_line,
)
from paged_llm.jobs.output import RowWriter
from paged_llm.jobs.requests import JobRequest, run_requests
from paged_llm.llm import LLM
from paged_llm.outputs import PoolingOutput, PoolingRequestOutput
from paged_llm.pooling_params import PoolingParams

_Embedding = PoolingRequestOutput[PoolingOutput]


def wrong_runner(request: BatchRequest, pooling: bool) -> RequestError:
    """The error of a line this run-batch's model cannot serve (``pooling``: it is a
    pooling model)."""
    if pooling:
        return RequestError(
            f"url {request.url!r} generates text, and this run-batch runs a pooling model "
            f"(--runner pooling), which serves {EMBEDDINGS_URL} only: run the generation lines "
            "in a run-batch without --runner pooling",
            parameter="url",
        )
    return RequestError(
        f"url {EMBEDDINGS_URL!r} needs a pooling model, and this run-batch generates: run the "
        "embeddings lines with `paged-llm run-batch --runner pooling`",
        parameter="url",
    )


def pooling_params(request: BatchRequest) -> PoolingParams:
    """The body's `PoolingParams`; a `RequestError` names the field out of range."""
    try:
        return PoolingParams(
            dimensions=request.body.get("dimensions"),
            truncate_prompt_tokens=request.body.get("truncate_prompt_tokens"),
        )
    except VLLMValidationError as error:
        raise RequestError.of(error) from None


def run_embedding_lines(
    adapters: LoRAModules,
    served: list[str],
    llm: LLM,
    requests: Sequence[BatchRequest],
    writer: RowWriter,
    *,
    progress: bool,
) -> None:
    """The output line of each embeddings request (an error line for a bad line), written
    once all its inputs are embedded (or at its first input that cannot be). A body's
    ``model`` selects a registered LoRA adapter as for chat lines."""
    # Each engine request's line (an index into requests) and input (None: the line's own
    # error, which names no input).
    parts: list[tuple[int, int | None]] = []
    prepared: list[JobRequest | RequestError] = []
    embeddings: list[list[_Embedding | None]] = []
    for line, request in enumerate(requests):
        try:
            if request.error is not None:
                raise request.error
            lora = adapters.select(request.body.get("model"), "model", served)
            params = pooling_params(request)
            inputs = embedding_inputs(request)
        except RequestError as error:
            parts.append((line, None))
            prepared.append(error)
            embeddings.append([])
            continue
        embeddings.append([None] * len(inputs))
        for number, prompt in enumerate(inputs):
            parts.append((line, number))
            prepared.append(JobRequest(prompt, params, lora))
    done = [False] * len(requests)
    for part, result in run_requests(llm, prepared, progress=progress, task="embed"):
        line, position = parts[part]
        if done[line]:
            continue
        request = requests[line]
        if isinstance(result, RequestError):
            done[line] = True
            failed = result if position is None else _located(result, position, embeddings[line])
            writer.write(error_line(request, failed), error=True)
            continue
        assert isinstance(result, PoolingRequestOutput) and position is not None
        embeddings[line][position] = result
        if all(embedding is not None for embedding in embeddings[line]):
            done[line] = True
            finished = [embedding for embedding in embeddings[line] if embedding is not None]
            body = response_body(request, finished, served[0])
            writer.write(
                response_line(request, body),
                error=False,
                prompt_tokens=body["usage"]["prompt_tokens"],
            )


# The body's field for each of the engine's parameter names.
_BODY_FIELDS = {"lora_request": "model", "prompt": "input", "prompt_token_ids": "input"}


def _located(error: RequestError, position: int, inputs: list[Any]) -> RequestError:
    """The engine's error of one of a line's ``inputs``, naming the input where the body
    has several, and the body's field for the engine's parameter."""
    parameter = _BODY_FIELDS.get(error.parameter or "", error.parameter)
    reason = f"input[{position}]: {error.reason}" if len(inputs) > 1 else error.reason
    return RequestError(reason, parameter=parameter, value=error.value)


def response_body(
    request: BatchRequest, embeddings: list[_Embedding], model: str
) -> dict[str, Any]:
    """OpenAI's embeddings response of one line: one entry per input, in order."""
    base64_encoded = request.body.get("encoding_format") == "base64"
    prompt_tokens = sum(len(embedding.prompt_token_ids) for embedding in embeddings)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(embedding.outputs.data, base64_encoded),
            }
            for index, embedding in enumerate(embeddings)
        ],
        "model": request.body.get("model") or model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encoded(vector: Any, base64_encoded: bool) -> list[float] | str:
    if not base64_encoded:
        return list(vector.tolist())
    # NOTE: OpenAI's base64 embeddings are little-endian float32, whatever the host's order.
    raw = np.asarray(vector.numpy(), dtype="<f4").tobytes()
    return base64.b64encode(raw).decode("ascii")
