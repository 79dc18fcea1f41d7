"""paged_llm: offline batch inference with a paged KV cache, prefix caching and continuous
batching, behind vLLM's offline API."""

from paged_llm.engine_args import EngineArgs
from paged_llm.frontend.llm_engine import LLMEngine
from paged_llm.inputs import TextPrompt, TokensPrompt
from paged_llm.llm import LLM
from paged_llm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringRequestOutput,
)
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.structured_outputs import StructuredOutputsParams
from paged_llm.vllm_names import refusal

# As ``from vllm import LLM, SamplingParams, TokensPrompt`` (lm-eval's vLLM wrapper's import).
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> object:
    """vLLM's names that paged_llm does not reproduce fail with a message saying why."""
    raise refusal("paged_llm", name)
