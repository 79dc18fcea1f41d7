"""Quickstart: answer a few dozen chat questions in one batch with the embedded model.

    python examples/quickstart.py                 # 36 questions, 64 tokens each
    python examples/quickstart.py --num-prompts 3 --max-tokens 8

The first run converts the embedded SmolLM2-135M-Instruct GGUF into ~/.cache/paged_llm
(about ten seconds); later runs load the converted copy.
"""

from __future__ import annotations

import argparse
import time

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for staying focused while studying.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about autumn leaves.",
    "How many days are there in a leap year?",
    "What does a CPU do in a computer?",
    "Suggest a name for a friendly golden retriever.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is 12 multiplied by 8?",
    "Name three planets in our solar system.",
    "How do I boil an egg?",
    "What is the largest ocean on Earth?",
    "Give a short definition of democracy.",
    "What are the primary colors?",
    "Write one sentence to encourage someone before an exam.",
    "What is the boiling point of water at sea level in Celsius?",
    "Who wrote 'Romeo and Juliet'?",
    "What is a prime number?",
    "List two benefits of regular exercise.",
    "What causes the seasons on Earth?",
    "How do bees make honey?",
    "Describe the taste of a lemon.",
    "What is the purpose of a seatbelt?",
    "Explain what a noun is to a child.",
    "What is the tallest mountain in the world?",
    "Give me an idea for a weekend hobby.",
    "Why do we need sleep?",
    "What is the chemical symbol for gold?",
    "How can I save water at home?",
    "What is the opposite of 'ancient'?",
    "Summarize the story of Cinderella in two sentences.",
    "What does 'recycle' mean?",
    "What is the freezing point of water in Fahrenheit?",
    "Recommend a good habit to start each morning.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    # The KV cache is sized from max_model_len: ask for what the job needs, not the
    # model's 8192.
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--show", type=int, default=4, help="Q/A pairs to print")
    args = parser.parse_args()

    # Cycle through the questions when more prompts than questions are asked for.
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_prompts)]
    conversations = [[{"role": "user", "content": q}] for q in questions]

    started = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len)
    loaded = time.perf_counter()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    outputs = llm.chat(conversations, params)
    finished = time.perf_counter()

    for question, output in list(zip(questions, outputs, strict=True))[: args.show]:
        print(f"Q: {question}\nA: {output.outputs[0].text.strip()}\n")
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    seconds = finished - loaded
    print(
        f"Loaded {args.model} in {loaded - started:.1f} s. Generated {num_output_tokens} tokens "
        f"for {len(outputs)} prompts ({num_prompt_tokens} prompt tokens) in {seconds:.1f} s: "
        f"{num_output_tokens / seconds:.1f} output tokens/s."
    )


if __name__ == "__main__":
    main()
