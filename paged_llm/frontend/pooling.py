"""The front end of `LLM`'s pooling calls (embed, classify, score, reward, encode): one
pooling task over every prompt through the intake and the result stream, and the pairs of
`LLM.score` (vLLM's 1-to-1, 1-to-N and N-to-N), scored by a cross-encoder on the pair
joined as its tokenizer joins a text pair, or as the cosine of two embeddings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any, cast

import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from paged_llm.frontend.engine_client import EngineClient
from paged_llm.frontend.input_processor import (
    InputProcessor,
    RejectedRequest,
    prompt_list,
    prompt_text,
)
from paged_llm.frontend.lora_requests import lora_per_prompt
from paged_llm.frontend.pooling_requests import check_task
from paged_llm.frontend.stream import GenerationLock, GenerationStream
from paged_llm.inputs import LoRARequest, PromptType
from paged_llm.outputs import (
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from paged_llm.pooling_params import PoolingParams

PoolingResult = PoolingRequestOutput[PoolingOutput]


@dataclasses.dataclass
class PoolingCall:
    """What every pooling call of one `LLM` shares: its intake, engine and lock."""

    processor: InputProcessor
    engine: EngineClient
    lock: GenerationLock
    log_stats: bool

    def stream(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None,
        task: str,
        use_tqdm: bool | Callable[..., tqdm],
        on_error: str,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None,
        tokenization_kwargs: dict[str, Any] | None,
        truncate_prompt_tokens: int | None,
    ) -> GenerationStream[PoolingResult]:
        """``task`` over every prompt, validated here (under ``on_error="raise"`` the first
        refused request raises now); the stream yields each output as it finishes."""
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
        pooler = self.processor.config.pooler
        if pooler is not None:
            check_task(pooler, task)
        prompts_given = prompt_list(prompts)
        params = _params_per_prompt(pooling_params, len(prompts_given), truncate_prompt_tokens)
        requests = self.processor.process_pooling(
            prompts_given,
            params,
            task,
            tokenization_kwargs=tokenization_kwargs,
            lora_requests=lora_per_prompt(lora_request, len(prompts_given)),
        )
        if on_error == "raise":
            for request in requests:
                if isinstance(request, RejectedRequest):
                    raise request.error
        return GenerationStream(
            self.engine,
            requests,
            self.lock,
            use_tqdm,
            skip_errors=on_error == "skip",
            log_stats=self.log_stats,
        )

    def run(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None,
        task: str,
        use_tqdm: bool | Callable[..., tqdm],
        on_error: str,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None,
        tokenization_kwargs: dict[str, Any] | None,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingResult]:
        """``task`` over every prompt; one output per prompt, in input order (a refused
        one, under ``on_error="skip"``, with ``error`` set and ``outputs`` None)."""
        stream = self.stream(
            prompts, pooling_params, task, use_tqdm, on_error, lora_request,
            tokenization_kwargs, truncate_prompt_tokens,
        )  # fmt: skip
        results: list[PoolingResult | None] = [None] * stream.num_requests
        try:
            for index, result in stream.results():
                results[index] = (
                    _error_output(result) if isinstance(result, RejectedRequest) else result
                )
        finally:
            stream.close()
        outputs = [result for result in results if result is not None]
        assert len(outputs) == stream.num_requests
        return outputs


def _params_per_prompt(
    pooling_params: PoolingParams | SequenceABC[PoolingParams] | None,
    num_prompts: int,
    truncate_prompt_tokens: int | None,
) -> list[object]:
    """One PoolingParams per prompt (a default one for None), with the call's
    ``truncate_prompt_tokens`` over each where given."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params: list[object] = [pooling_params or PoolingParams()] * num_prompts
    elif isinstance(pooling_params, (list, tuple)):
        params = list(pooling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"Got {len(params)} PoolingParams for {num_prompts} prompts; pass one "
                "PoolingParams for all prompts or a list with exactly one per prompt."
            )
    else:
        raise ValueError(
            "pooling_params must be a PoolingParams, a list with one per prompt, or None, got "
            f"{type(pooling_params).__name__}."
        )
    if truncate_prompt_tokens is None:
        return params
    return [
        dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
        if isinstance(p, PoolingParams)
        else p
        for p in params
    ]


def _error_output(rejected: RejectedRequest) -> PoolingResult:
    """A refused request as a pooling call reports it: ``error`` its reason."""
    return PoolingRequestOutput(
        request_id=rejected.request_id,
        outputs=cast(Any, None),
        prompt_token_ids=rejected.prompt_token_ids,
        prompt=rejected.prompt,
        error=str(rejected.error),
        error_parameter=rejected.error.parameter,
    )


def score_pairs(
    data_1: PromptType | SequenceABC[PromptType], data_2: PromptType | SequenceABC[PromptType]
) -> list[tuple[Any, Any]]:
    """The pairs `LLM.score` scores, as vLLM forms them: one first prompt against each
    second one (1-to-N), or the i-th against the i-th (N-to-N)."""
    first, second = prompt_list(data_1), prompt_list(data_2)
    if not first:
        raise ValueError("LLM.score: at least one text element must be given (data_1 is empty).")
    if not second:
        raise ValueError(
            "LLM.score: at least one text_pair element must be given (data_2 is empty)."
        )
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(
            f"LLM.score: input lengths must be either 1:1, 1:N or N:N, got {len(first)} and "
            f"{len(second)}; pass one first prompt, or as many as second ones."
        )
    if len(first) == 1:
        first = first * len(second)
    return list(zip(first, second, strict=True))


def _token_ids(prompt: Any, tokenizer: PreTrainedTokenizerBase | None, side: str) -> list[int]:
    text = prompt_text(prompt)
    if text is None:
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise ValueError(
                f"LLM.score: each {side} must be a str, a {{'prompt': str}} or a "
                f"{{'prompt_token_ids': [...]}} dict, got {type(prompt).__name__}."
            )
        return [int(t) for t in prompt["prompt_token_ids"]]
    if tokenizer is None:
        raise ValueError(
            f"LLM.score: a text {side} needs a tokenizer, and this LLM was built with "
            "skip_tokenizer_init=True; pass {'prompt_token_ids': [...]} instead."
        )
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def cross_encoder_prompts(
    pairs: list[tuple[Any, Any]],
    tokenizer: PreTrainedTokenizerBase | None,
    tokenization_kwargs: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """Each pair as one prompt for a cross-encoder: text pairs joined by the tokenizer
    (``tokenizer(text, text_pair)``, in one batched call), pairs given as token ids by its
    ``build_inputs_with_special_tokens`` (concatenated without a tokenizer)."""
    texts = [(prompt_text(a), prompt_text(b)) for a, b in pairs]
    if tokenizer is not None and all(a is not None and b is not None for a, b in texts):
        encoded = tokenizer(
            [a for a, _ in texts], [b for _, b in texts], **(tokenization_kwargs or {})
        )
        return [{"prompt_token_ids": list(ids)} for ids in encoded["input_ids"]]
    prompts = []
    for first, second in pairs:
        ids_1 = _token_ids(first, tokenizer, "data_1 prompt")
        ids_2 = _token_ids(second, tokenizer, "data_2 prompt")
        joined = (
            ids_1 + ids_2
            if tokenizer is None
            else tokenizer.build_inputs_with_special_tokens(ids_1, ids_2)
        )
        prompts.append({"prompt_token_ids": list(joined)})
    return prompts


def cosine_scores(
    pairs: list[tuple[int, int]], embeddings: list[PoolingResult]
) -> list[ScoringRequestOutput]:
    """The cosine of the embeddings of each pair (indices into ``embeddings``); a pair with
    a refused side reports that side's error."""
    outputs = []
    for first, second in pairs:
        a, b = embeddings[first], embeddings[second]
        failed = a if a.error is not None else b if b.error is not None else None
        score = (
            None
            if failed is not None
            else ScoringOutput(
                F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0).item()
            )
        )
        outputs.append(
            ScoringRequestOutput(
                request_id=f"{a.request_id}_{b.request_id}",
                outputs=cast(Any, score),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
                error=None if failed is None else failed.error,
                error_parameter=None if failed is None else failed.error_parameter,
            )
        )
    return outputs
