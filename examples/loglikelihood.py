"""Multiple-choice scoring with prompt logprobs, the evaluation-harness pattern.

For each question and each choice, the prompt is context + choice, and the choice's score
is the sum of the log probabilities of its tokens given everything before them. One
generated token is the least a request can ask for; ``prompt_logprobs=0`` returns the
logprob of each prompt token itself. The highest-scoring choice is the model's answer.

    python examples/loglikelihood.py
    python examples/loglikelihood.py --num-questions 3
"""

from __future__ import annotations

import argparse

from transformers import PreTrainedTokenizerBase

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

# (question, choices, index of the correct choice)
QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "purple", "black"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "ten"], 1),
    ("What is the opposite of hot?", ["warm", "loud", "cold", "tall"], 2),
    ("Which animal says 'meow'?", ["cow", "duck", "dog", "cat"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Which season comes after winter?", ["autumn", "summer", "spring", "night"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
]


def context_and_choice_tokens(
    tokenizer: PreTrainedTokenizerBase, context: str, choice: str
) -> tuple[list[int], list[int]]:
    """Token ids of the context and of the choice that follows it.

    The pair is encoded as one string and split where the context's own encoding ends, so
    the choice tokens are the ones the model would really see after the context.
    """
    whole = tokenizer.encode(context + choice, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    if whole[: len(context_ids)] != context_ids:
        # A token spans the boundary; fall back to encoding the two parts separately.
        return context_ids, tokenizer.encode(choice, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-model-len", type=int, default=256)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=args.max_model_len)
    questions = QUESTIONS[: args.num_questions]
    prompts, spans = [], []
    for question, choices, _ in questions:
        context = f"Question: {question}\nAnswer:"
        for choice in choices:
            # The space before the choice belongs to the choice, as in the harness.
            context_ids, choice_ids = context_and_choice_tokens(
                llm.tokenizer, context, " " + choice
            )
            prompts.append({"prompt_token_ids": context_ids + choice_ids})
            spans.append((len(context_ids), len(context_ids) + len(choice_ids)))

    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    scores = []
    for output, (start, end) in zip(outputs, spans, strict=True):
        token_ids = output.prompt_token_ids
        # prompt_logprobs[i] maps token_ids[i] (and, with prompt_logprobs=k, the k most
        # likely tokens) to a Logprob; position 0 is None.
        scores.append(
            sum(output.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, end))
        )

    num_correct = 0
    offset = 0
    for question, choices, answer in questions:
        choice_scores = scores[offset : offset + len(choices)]
        offset += len(choices)
        best = max(range(len(choices)), key=choice_scores.__getitem__)
        num_correct += best == answer
        mark = "ok" if best == answer else f"wrong, expected {choices[answer]!r}"
        detail = ", ".join(f"{c} {s:.2f}" for c, s in zip(choices, choice_scores, strict=True))
        print(f"{question} -> {choices[best]!r} ({mark}) [{detail}]")
    print(f"Accuracy: {num_correct}/{len(questions)} = {num_correct / len(questions):.0%}")


if __name__ == "__main__":
    main()
