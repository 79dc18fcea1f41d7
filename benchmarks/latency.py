"""Latency against concurrency: TTFT and inter-token latency of paged_llm.

Fixed input and output lengths, random prompt tokens, greedy with EOS ignored. After a
warm-up, each concurrency level submits exactly that many requests at once in one
``generate`` call (``max_num_seqs`` is the highest level, so none waits for a slot), and
repeats until it has at least ``--min-samples`` requests. For each level it reports TTFT and
inter-token latency at p50 / p90 / p99 over requests, from ``RequestOutput.metrics``, and
the output throughput, which together trace the throughput-latency curve.

Run from the repository root:
    python -m benchmarks.latency --input-len 128 --output-len 64
    python -m benchmarks.latency --device cuda --random-weights-config llama-3.2-1b
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.engines import generate_greedy
from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    benchmark_model_dir,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.workloads import RANDOM_TOKEN_ID_LIMIT, random_token_requests

PERCENTILES = (50, 90, 99)


@dataclass
class LevelResult:
    """One concurrency level: latency percentiles (seconds) and throughput."""

    concurrency: int
    num_requests: int
    wall_seconds: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    # Per request, the mean time between consecutive generated tokens.
    itl_p50: float
    itl_p90: float
    itl_p99: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32",
        help="comma-separated numbers of requests submitted together",
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=8,
        help="repeat a level until it has this many requests, so low levels have percentiles",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    args.concurrency = sorted({int(level) for level in args.concurrency.split(",")})
    if args.concurrency[0] < 1:
        parser.error("--concurrency levels must be >= 1")
    resolve_device_arguments(args)
    return args


def percentiles(values: list[float]) -> list[float]:
    return [float(v) for v in np.percentile(values, PERCENTILES)]


def run_level(llm: Any, args: argparse.Namespace, concurrency: int, seed: int) -> LevelResult:
    """Submit ``concurrency`` requests at once, as often as ``--min-samples`` needs."""
    vocab_limit = min(RANDOM_TOKEN_ID_LIMIT, llm.vocab_size)
    ttfts: list[float] = []
    itls: list[float] = []
    wall_seconds = 0.0
    num_output_tokens = 0
    for repeat in range(math.ceil(args.min_samples / concurrency)):
        requests = random_token_requests(
            concurrency, args.input_len, args.output_len, seed + repeat, vocab_limit
        )
        started = time.perf_counter()
        outputs = generate_greedy(llm, requests)
        wall_seconds += time.perf_counter() - started
        for output in outputs:
            metrics = output.metrics
            assert metrics is not None and metrics.time_to_first_token is not None
            ttfts.append(metrics.time_to_first_token)
            if metrics.inter_token_latency is not None:
                itls.append(metrics.inter_token_latency)
            num_output_tokens += len(output.outputs[0].token_ids)
    ttft = percentiles(ttfts)
    # One output token has no inter-token gap.
    itl = percentiles(itls) if itls else [math.nan] * len(PERCENTILES)
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(ttfts),
        wall_seconds=wall_seconds,
        output_tokens_per_s=num_output_tokens / wall_seconds,
        ttft_p50=ttft[0],
        ttft_p90=ttft[1],
        ttft_p99=ttft[2],
        itl_p50=itl[0],
        itl_p90=itl[1],
        itl_p99=itl[2],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from paged_llm import LLM

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, args.threads)
    with (
        benchmark_model_dir(args) as model_dir,
        LLM(
            model_dir,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=max(args.concurrency),
            max_num_batched_tokens=args.max_num_batched_tokens,
        ) as llm,
    ):
        # Warm-up: one batch at the full lengths, with prompts no level uses.
        warmup = random_token_requests(
            min(4, max(args.concurrency)), args.input_len, args.output_len, args.seed - 1, 1000
        )
        generate_greedy(llm, warmup)
        # Each level gets its own prompt seeds, so no level hits another's prefix cache.
        levels = [
            run_level(llm, args, concurrency, seed=args.seed + 1000 * index)
            for index, concurrency in enumerate(args.concurrency)
        ]
        settings = {
            "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
            "max_model_len": llm.config.max_model_len,
        }

    print(machine_line(machine, args.device, args.dtype))
    print(
        f"paged_llm, {args.input_len} prompt tokens -> {args.output_len} output tokens per "
        f"request, greedy, EOS ignored; max_num_seqs {settings['max_num_seqs']}, "
        f"max_num_batched_tokens {settings['max_num_batched_tokens']}\n"
    )
    headers = ["concurrency", "requests", "wall s", "out tok/s"]
    headers += [f"TTFT p{p} ms" for p in PERCENTILES] + [f"ITL p{p} ms" for p in PERCENTILES]
    rows = [
        [
            level.concurrency,
            level.num_requests,
            level.wall_seconds,
            level.output_tokens_per_s,
            *(1000 * v for v in (level.ttft_p50, level.ttft_p90, level.ttft_p99)),
            *(1000 * v for v in (level.itl_p50, level.itl_p90, level.itl_p99)),
        ]
        for level in levels
    ]
    print(format_table(headers, rows))
    print(
        "\nTTFT: submission to first token. ITL: a request's mean time between consecutive "
        "tokens; percentiles are over requests."
    )
    result = {
        "benchmark": "latency",
        "machine": machine,
        "args": vars(args),
        "settings": settings,
        "levels": [asdict(level) for level in levels],
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
