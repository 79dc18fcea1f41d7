"""On-policy reinforcement learning: paged_llm samples the rollouts, transformers takes the
optimizer step, `LLM.update_weights` pushes the new weights back into the engine.

The policy learns to write lowercase words only: each iteration samples ``--samples``
rollouts of every prompt (seeded), rewards each by the share of its tokens that are
lowercase letters (with or without a leading space), takes one REINFORCE step (the rollout's token log-probabilities under transformers, times
its reward minus the prompt's mean reward) and updates the engine in place: no new `LLM`,
no reload, the prefix cache emptied by the update. With ``--check``, every iteration also
verifies that the engine now generates exactly what transformers generates with the
trained weights (greedy, one prompt at a time).

    python examples/rl_rollouts.py                       # the embedded SmolLM2
    python examples/rl_rollouts.py --model path/to/model --iterations 10 --check
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL, resolve_model

PROMPTS = [
    "Write one word:",
    "Say something short.",
    "Name a colour.",
    "Reply with a greeting.",
]


@dataclass
class Iteration:
    mean_reward: float
    rollout_seconds: float
    train_seconds: float
    update_seconds: float
    # With --check: whether the engine's greedy tokens equal transformers' after the update.
    matches_transformers: bool | None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--check", action="store_true", help="compare with transformers")
    return parser.parse_args(argv)


def lowercase_tokens(tokenizer: transformers.PreTrainedTokenizerBase) -> set[int]:
    """The ids of the tokens that are lowercase letters, after an optional space."""
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    # Byte-level BPE writes a leading space as "Ġ".
    words = (text.removeprefix("Ġ") for text in texts)
    return {i for i, word in enumerate(words) if word.isalpha() and word.islower()}


def sequence_logprob(
    policy: transformers.PreTrainedModel, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """The sum of the completion's token log-probabilities under ``policy``."""
    ids = torch.tensor([prompt + completion])
    logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).sum()


def transformers_greedy(
    policy: transformers.PreTrainedModel, prompt: list[int], max_tokens: int
) -> list[int]:
    with torch.no_grad():
        out = policy.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def main(argv: list[str] | None = None) -> list[Iteration]:
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else resolve_model(DEFAULT_MODEL).path
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rewarded = lowercase_tokens(tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(policy.parameters(), lr=args.learning_rate)
    iterations = []
    with LLM(model_dir, dtype="float32", max_model_len=256, seed=0) as llm:
        for step in range(args.iterations):
            started = time.perf_counter()
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(
                    n=args.samples, temperature=1.0, max_tokens=args.max_tokens, seed=step
                ),
                use_tqdm=False,
            )
            rollout_seconds = time.perf_counter() - started

            started = time.perf_counter()
            policy.train()
            optimizer.zero_grad()
            rewards = []
            for prompt, output in zip(prompts, outputs, strict=True):
                completions = [list(c.token_ids) for c in output.outputs if c.token_ids]
                scores = [sum(t in rewarded for t in c) / len(c) for c in completions]
                baseline = sum(scores) / len(scores)
                for completion, score in zip(completions, scores, strict=True):
                    advantage = score - baseline
                    if advantage:
                        loss = -advantage * sequence_logprob(policy, prompt, completion)
                        (loss / len(completions)).backward()
                rewards.extend(scores)
            optimizer.step()
            policy.eval()
            train_seconds = time.perf_counter() - started

            started = time.perf_counter()
            llm.update_weights(policy.named_parameters())
            update_seconds = time.perf_counter() - started

            matches = None
            if args.check:
                greedy = SamplingParams(
                    temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
                )
                engine = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
                )
                matches = all(
                    list(out.outputs[0].token_ids)
                    == transformers_greedy(policy, p, args.max_tokens)
                    for p, out in zip(prompts, engine, strict=True)
                )
            iteration = Iteration(
                sum(rewards) / len(rewards), rollout_seconds, train_seconds, update_seconds, matches
            )
            iterations.append(iteration)
            print(
                f"iteration {step}: mean reward {iteration.mean_reward:.3f}; rollouts "
                f"{rollout_seconds:.2f} s, training step {train_seconds:.2f} s, update_weights "
                f"{update_seconds:.3f} s"
                + ("" if matches is None else f"; engine equals transformers: {matches}")
            )
    return iterations


if __name__ == "__main__":
    main()
