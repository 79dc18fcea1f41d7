"""vLLM's examples/offline_inference/prefix_caching.py: the same answers with and without the
prefix cache, the first LLM freed before the second is built."""

import sys

from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory

prefix = (
    "You are an expert school principal, skilled in effectively managing "
    "faculty and staff. Draft 10-15 questions for a potential first grade "
    "Head Teacher for my K-12, all-girls', independent school that emphasizes "
    "community, joyful discovery, and life-long learning. Fulfill the following: "
)
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
generating_prompts = [prefix + prompt for prompt in prompts]
sampling_params = SamplingParams(temperature=0.0, max_tokens=8)


def main():
    regular_llm = LLM(model=sys.argv[1], enable_prefix_caching=False, max_model_len=256)
    outputs = regular_llm.generate(generating_prompts, sampling_params)
    regular_generated_texts = [output.outputs[0].text for output in outputs]

    del regular_llm
    cleanup_dist_env_and_memory()

    prefix_cached_llm = LLM(model=sys.argv[1], enable_prefix_caching=True, max_model_len=256)
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
    cached_generated_texts = [output.outputs[0].text for output in outputs]

    generated_same = all(
        regular_generated_texts[i] == cached_generated_texts[i] for i in range(len(prompts))
    )
    print(f"Generated answers are the same: {generated_same}")
    return generated_same, outputs


if __name__ == "__main__":
    generated_same, outputs = main()
