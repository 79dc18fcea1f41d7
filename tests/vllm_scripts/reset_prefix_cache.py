"""A prefix hit, then vLLM's ``LLM.reset_prefix_cache()``: the same prompt computes anew."""

import sys

from vllm import LLM, SamplingParams

prompt = "The quick brown fox jumps over the lazy dog. " * 4
params = SamplingParams(temperature=0.0, max_tokens=4)

llm = LLM(model=sys.argv[1], max_model_len=128)
first = llm.generate(prompt, params)[0]
cached = llm.generate(prompt, params)[0]
was_reset = llm.reset_prefix_cache()
after_reset = llm.generate(prompt, params)[0]
