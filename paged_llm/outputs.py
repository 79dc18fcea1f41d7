"""What `LLM` returns, shaped like vLLM's outputs: `RequestOutput` and `CompletionOutput` for
generations, `PoolingRequestOutput` and its typed forms for pooling requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from paged_llm.lora.request import LoRARequest


@dataclass(slots=True)
class Logprob:
    """Log probability of one token at one position.

    ``rank`` is 1 for the most likely token of the model's distribution.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> its Logprob.
SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob (nothing precedes it), hence None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string; ``stop_reason``
    names the token id or string, None for EOS) or "length" (``max_tokens`` or the
    model's context length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The LoRA adapter it was generated under; None: the base model.
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) in the life of one request.

    The fields have the names of vLLM's V0 ``RequestMetrics``; the ``*_ts`` properties and
    ``first_token_latency`` give the same times under the names of vLLM's V1
    ``RequestStateStats`` (there monotonic-clock stamps, here wall-clock: differences agree).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Tokens of the longest completion; with the token times it gives the decode pace.
    num_generation_tokens: int = 0

    @property
    def queued_ts(self) -> float:
        """A request is queued when it arrives."""
        return self.arrival_time

    @property
    def scheduled_ts(self) -> float | None:
        return self.first_scheduled_time

    @property
    def first_token_ts(self) -> float | None:
        return self.first_token_time

    @property
    def last_token_ts(self) -> float | None:
        return self.last_token_time

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first token (vLLM V1's name)."""
        return self.time_to_first_token

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latency(self) -> float | None:
        """Mean seconds between consecutive generated tokens."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    """The result of one prompt: its completions and how they were produced.

    ``num_cached_tokens`` counts prompt tokens served from the prefix cache. ``error`` is
    set (and ``outputs`` empty) only for a request that failed under ``on_error="skip"``:
    refused at submission, or stopped by the engine (its constraints left no token to
    generate); ``error_parameter`` then names the parameter at fault, where one is.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None
    error_parameter: str | None = None
    # The LoRA adapter the request ran under; None: the base model.
    lora_request: LoRARequest | None = None

    # vLLM's fields for features paged_llm does not have, so that scripts reading them run.
    @property
    def encoder_prompt(self) -> None:
        """Always None: decoder-only models only."""
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        """Always None: decoder-only models only."""
        return None

    @property
    def multi_modal_placeholders(self) -> dict[str, Any]:
        """Always empty: text prompts only."""
        return {}

    @property
    def kv_transfer_params(self) -> None:
        """Always None: no disaggregated prefill."""
        return None


@dataclass
class BeamSearchSequence:
    """One sequence found by `LLM.beam_search`, with the fields of vLLM's.

    ``tokens`` holds the prompt and the generated tokens (an EOS that ended the beam
    included); ``logprobs`` one dict per generated token, over the candidates the beam's
    step scored; ``cum_logprob`` the sum of the generated tokens' logprobs; ``text`` the
    decoded ``tokens``, prompt included, the ending EOS left out unless
    ``include_stop_str_in_output``. ``finish_reason`` is "stop" for a beam that ended with
    EOS (``stop_reason`` is then that token id) and "length" for one that ran to
    ``max_tokens`` or ``max_model_len``.
    """

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


# ----- pooling ----------------------------------------------------------------------------


@dataclass
class PoolingOutput:
    """What the pooler made of one prompt: a vector (``[hidden_size]`` or ``[num_labels]``),
    or one per prompt token (``[num_tokens, ...]``), float32 on the CPU."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    """One prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (the raw logits under ``use_activation=False``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One pair's score: the cosine of two embeddings, or a cross-encoder's output."""

    score: float


PoolingOutputT = TypeVar("PoolingOutputT")


@dataclass
class PoolingRequestOutput(Generic[PoolingOutputT]):
    """The result of one pooling request (vLLM's ``PoolingRequestOutput``): ``outputs`` holds
    a `PoolingOutput` (`LLM.encode`, `LLM.reward`), or its typed form in the subclasses.

    ``error`` is set (and ``outputs`` None) only for a request that failed under
    ``on_error="skip"``; ``error_parameter`` then names the parameter at fault."""

    request_id: str
    outputs: PoolingOutputT
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_parameter: str | None = None
    lora_request: LoRARequest | None = None


def _typed(
    output: PoolingRequestOutput[Any], outputs: Any
) -> dict[str, Any]:  # the fields of ``output`` with other ``outputs``
    return {
        "request_id": output.request_id,
        "outputs": outputs,
        "prompt_token_ids": output.prompt_token_ids,
        "finished": output.finished,
        "prompt": output.prompt,
        "num_cached_tokens": output.num_cached_tokens,
        "metrics": output.metrics,
        "error": output.error,
        "error_parameter": output.error_parameter,
        "lora_request": output.lora_request,
    }


def _data(output: PoolingRequestOutput[Any]) -> torch.Tensor | None:
    return None if output.outputs is None else output.outputs.data


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """`LLM.embed`'s result: ``outputs.embedding``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[Any]) -> EmbeddingRequestOutput:
        data = _data(output)
        return cls(**_typed(output, None if data is None else EmbeddingOutput(data.tolist())))


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """`LLM.classify`'s result: ``outputs.probs``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[Any]) -> ClassificationRequestOutput:
        data = _data(output)
        return cls(**_typed(output, None if data is None else ClassificationOutput(data.tolist())))


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """`LLM.score`'s result: ``outputs.score``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[Any]) -> ScoringRequestOutput:
        data = _data(output)
        return cls(**_typed(output, None if data is None else ScoringOutput(data.item())))


# What an engine reports of a request: a generation's output or a pooling one's.
EngineOutput = RequestOutput | PoolingRequestOutput[PoolingOutput]
