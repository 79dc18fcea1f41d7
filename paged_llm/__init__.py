"""paged_llm: offline batch inference with a paged KV cache, prefix caching and continuous
batching, behind vLLM's offline API."""

from paged_llm.llm import LLM
from paged_llm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
