"""Multiple-choice scoring, lm-eval's loglikelihood pattern: every choice of a question is
one prompt, context + choice, scored with prompt logprobs, all questions in one `generate`
call. Two ways in one run, each in a fresh `LLM` (an empty prefix cache):

- whole: ``prompt_logprobs=1``: every prompt position is scored, so nothing can come from
  the prefix cache and every choice computes its context;
- continuation: ``prompt_logprobs_start=len(context)`` as paged_llm's lm-eval model asks:
  only the choice is scored, the context's blocks are shared through the prefix cache.

The two must give the same choice scores.

Run from the repository root:
    python -m benchmarks.shared_context_scoring --num-questions 32 --context-len 64
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    benchmark_model_dir,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.workloads import RANDOM_TOKEN_ID_LIMIT


@dataclass
class ScoringRun:
    way: str
    seconds: float
    prefix_cache_hit_rate: float
    # Per prompt: the sum of its choice tokens' logprobs.
    scores: list[float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-questions", type=int, default=32)
    parser.add_argument("--num-choices", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=64)
    parser.add_argument("--max-choice-len", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    resolve_device_arguments(args)
    return args


def questions(args: argparse.Namespace, vocab_limit: int) -> list[tuple[list[int], list[int]]]:
    """(context, choice) token pairs, the choices of a question consecutive, as lm-eval
    orders its requests."""
    rng = random.Random(args.seed)
    pairs = []
    for _ in range(args.num_questions):
        context = [rng.randrange(vocab_limit) for _ in range(args.context_len)]
        for _ in range(args.num_choices):
            length = rng.randint(1, args.max_choice_len)
            pairs.append((context, [rng.randrange(vocab_limit) for _ in range(length)]))
    return pairs


def run(model_dir: Path, args: argparse.Namespace, way: str) -> ScoringRun:
    from paged_llm import LLM, SamplingParams

    with LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.context_len + args.max_choice_len + 1,
    ) as llm:
        pairs = questions(args, min(RANDOM_TOKEN_ID_LIMIT, llm.vocab_size))
        params = [
            SamplingParams(
                max_tokens=1,
                prompt_logprobs=1,
                prompt_logprobs_start=len(context) if way == "continuation" else 0,
            )
            for context, _ in pairs
        ]
        prompts = [{"prompt_token_ids": context + choice} for context, choice in pairs]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        scores = []
        for (context, choice), output in zip(pairs, outputs, strict=True):
            assert output.prompt_logprobs is not None
            total = 0.0
            for position, token in enumerate(choice, len(context)):
                entry = output.prompt_logprobs[position]
                assert entry is not None
                total += entry[token].logprob
            scores.append(total)
        return ScoringRun(way, seconds, llm.get_engine_metrics().prefix_cache_hit_rate, scores)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, args.threads)
    with benchmark_model_dir(args) as model_dir:
        runs = [run(model_dir, args, way) for way in ("whole", "continuation")]
    whole, continuation = runs
    max_difference = max(abs(a - b) for a, b in zip(whole.scores, continuation.scores, strict=True))
    print(machine_line(machine, args.device, args.dtype))
    print(
        f"{args.num_questions} questions x {args.num_choices} choices, contexts of "
        f"{args.context_len} random tokens, choices of 1-{args.max_choice_len}\n"
    )
    rows = [[r.way, r.seconds, f"{r.prefix_cache_hit_rate:.1%}"] for r in runs]
    print(format_table(["scored", "seconds", "prefix cache hits"], rows))
    print(
        f"\nspeed-up {whole.seconds / continuation.seconds:.2f}x; largest difference of a "
        f"choice's score between the two: {max_difference:.2e}"
    )
    result = {
        "benchmark": "shared_context_scoring",
        "machine": machine,
        "args": vars(args),
        "runs": [asdict(r) for r in runs],
        "max_score_difference": max_difference,
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
