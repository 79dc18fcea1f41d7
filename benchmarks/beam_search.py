"""Beam search: paged_llm's, inside the engine, against vLLM's way of running it on the same
engine, and sampled generation of the same size as a floor.

vLLM's `LLM.beam_search` is a Python loop: every step it submits every live beam as a new
prompt to `generate` (one token, ``2 * beam_width`` logprobs), the prefix cache serving the
beams' shared history, and picks the next beams from the returned logprobs. That loop is
written here over paged_llm's `generate` (`loop_beam_search`), so both searches run on one
engine in one process; their results must be identical. The floor is `generate` with
``n=beam_width`` (sampled, seeded: vLLM refuses greedy ``n > 1``), EOS ignored: as many
sequences of the same length sharing their prompt's blocks, with no search.

Run from the repository root:
    python -m benchmarks.beam_search --num-prompts 8 --beam-width 4 --output-len 32
"""

from __future__ import annotations

import argparse
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
from benchmarks.workloads import RANDOM_TOKEN_ID_LIMIT, random_token_requests


@dataclass
class RepeatResult:
    """Seconds of one round of the three runs, and how many prompts' searches agreed."""

    engine_seconds: float
    loop_seconds: float
    sampled_seconds: float
    identical_prompts: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    resolve_device_arguments(args)
    return args


def loop_beam_search(llm: Any, prompts: list[list[int]], params: Any) -> list[list[list[int]]]:
    """vLLM's `LLM.beam_search` algorithm over `generate`: the tokens of each prompt's
    ``beam_width`` best beams, best first."""
    from paged_llm import SamplingParams

    width = params.beam_width
    eos_token_ids = llm.eos_token_ids
    step_params = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=0.0)
    live: list[list[tuple[list[int], float]]] = [[(list(prompt), 0.0)] for prompt in prompts]
    done: list[list[tuple[list[int], float]]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for prompt_beams in live for beam in prompt_beams]
        if not beams:
            break
        outputs = iter(
            llm.generate(
                [{"prompt_token_ids": tokens} for tokens, _ in beams], step_params, use_tqdm=False
            )
        )
        for index, prompt_beams in enumerate(live):
            candidates = []
            for tokens, cum_logprob in prompt_beams:
                for token_id, logprob in next(outputs).outputs[0].logprobs[0].items():
                    candidate = ([*tokens, token_id], cum_logprob + logprob.logprob)
                    if token_id in eos_token_ids and not params.ignore_eos:
                        done[index].append(candidate)
                    else:
                        candidates.append(candidate)
            live[index] = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:width]

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum_logprob = beam
        ended_by_eos = tokens[-1] in eos_token_ids and not params.ignore_eos
        return cum_logprob / (len(tokens) - ended_by_eos) ** params.length_penalty

    return [
        [tokens for tokens, _ in sorted(finished + beams, key=score, reverse=True)[:width]]
        for finished, beams in zip(done, live, strict=True)
    ]


def run_repeat(llm: Any, prompts: list[list[int]], args: argparse.Namespace) -> RepeatResult:
    from paged_llm import BeamSearchParams, SamplingParams

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len)
    token_prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
    started = time.perf_counter()
    ours = llm.beam_search(token_prompts, params)
    engine_seconds = time.perf_counter() - started
    started = time.perf_counter()
    theirs = loop_beam_search(llm, prompts, params)
    loop_seconds = time.perf_counter() - started
    sampled = SamplingParams(
        n=args.beam_width, seed=args.seed, max_tokens=args.output_len, ignore_eos=True
    )
    started = time.perf_counter()
    llm.generate(token_prompts, sampled, use_tqdm=False)
    sampled_seconds = time.perf_counter() - started
    identical = sum(
        [seq.tokens for seq in output.sequences] == expected
        for output, expected in zip(ours, theirs, strict=True)
    )
    return RepeatResult(engine_seconds, loop_seconds, sampled_seconds, identical)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from paged_llm import LLM, BeamSearchParams

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, args.threads)
    with (
        benchmark_model_dir(args) as model_dir,
        LLM(
            model_dir,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.input_len + args.output_len + 1,
        ) as llm,
    ):
        vocab_limit = min(RANDOM_TOKEN_ID_LIMIT, llm.vocab_size)
        warmup = random_token_requests(1, args.input_len, 2, args.seed - 1, vocab_limit)
        warmup_prompts = [request.prompt_token_ids for request in warmup]
        llm.beam_search(
            [{"prompt_token_ids": p} for p in warmup_prompts],
            BeamSearchParams(beam_width=args.beam_width, max_tokens=2),
        )
        # Each round gets its own prompts, so no round hits another's prefix cache.
        repeats = []
        for repeat in range(args.repeats):
            requests = random_token_requests(
                args.num_prompts,
                args.input_len,
                args.output_len,
                args.seed + repeat,
                vocab_limit,
            )
            prompts = [request.prompt_token_ids for request in requests]
            repeats.append(run_repeat(llm, prompts, args))

    print(machine_line(machine, args.device, args.dtype))
    print(
        f"{args.num_prompts} prompts of {args.input_len} random tokens, beam_width "
        f"{args.beam_width}, {args.output_len} tokens\n"
    )
    headers = ["round", "engine s", "vLLM-style loop s", "loop / engine", "sampled n s", "same"]
    rows = [
        [
            index,
            r.engine_seconds,
            r.loop_seconds,
            r.loop_seconds / r.engine_seconds,
            r.sampled_seconds,
            f"{r.identical_prompts}/{args.num_prompts}",
        ]
        for index, r in enumerate(repeats)
    ]
    print(format_table(headers, rows))
    print(
        f"\n'sampled n s': generate with n={args.beam_width}, sampled, EOS ignored, the same "
        "number and length of sequences without a search. 'same': prompts whose beams the "
        "two searches agree on."
    )
    result = {
        "benchmark": "beam_search",
        "machine": machine,
        "args": vars(args),
        "repeats": [asdict(r) for r in repeats],
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
