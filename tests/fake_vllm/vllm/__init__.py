"""A stand-in for the part of vLLM's offline API that benchmarks/peers/vllm_worker.py uses,
so that the worker's job and result round trip is tested without vLLM installed. Its
"greedy tokens" are `fake_token_ids` of the prompt."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


def fake_token_ids(prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    return [(sum(prompt_token_ids) + i) % 1000 for i in range(max_tokens)]


@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int
    ignore_eos: bool
    detokenize: bool


@dataclass
class CompletionOutput:
    token_ids: list[int]


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


class _EngineCoreClient:
    def shutdown(self) -> None:
        pass


class _LLMEngine:
    def __init__(self) -> None:
        self.engine_core = _EngineCoreClient()


class LLM:
    def __init__(self, **engine_args: Any) -> None:
        # vLLM reads its CPU settings from the environment as it builds the engine.
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            raise RuntimeError("VLLM_CPU_KVCACHE_SPACE was not set before the LLM was built.")
        self.engine_args = engine_args
        self.llm_engine = _LLMEngine()

    def generate(
        self,
        prompts: list[dict[str, list[int]]],
        sampling_params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        for params in sampling_params:
            if params.temperature != 0.0 or not params.ignore_eos:
                raise ValueError(f"the benchmark decodes greedily with EOS ignored, got {params}")
        return [
            RequestOutput([CompletionOutput(fake_token_ids(p["prompt_token_ids"], s.max_tokens))])
            for p, s in zip(prompts, sampling_params, strict=True)
        ]
