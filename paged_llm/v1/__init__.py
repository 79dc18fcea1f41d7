"""vLLM's `vllm.v1` module paths, re-exported: the code lives in paged_llm's own layout."""
