"""Where paged_llm's time goes: one throughput workload under ``torch.profiler``.

Runs a seeded workload of ``benchmarks.throughput`` (greedy, EOS ignored, as there) once
under the profiler and prints the operators by self CPU time, with their share of the
total: the table that "what limits speed" in docs/benchmarks.md is read from. The
profiler's bookkeeping slows the run a little; the wall time printed is the profiled one.

Run from the repository root:
    python -m benchmarks.op_profile --workload b
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from benchmarks.engines import generate_greedy
from benchmarks.models import add_model_arguments, resolve_benchmark_model
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import WORKLOAD_KINDS, WorkloadSpec, build_workload
from paged_llm import LLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=WORKLOAD_KINDS, default="b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--top", type=int, default=15, help="operators to list")
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="paged_llm_profile_") as tmp:
        model_dir = resolve_benchmark_model(
            args.model, args.random_weights_config, torch.float32, Path(tmp)
        )
        spec = WorkloadSpec(
            kind=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            min_output_len=args.output_len[0],
            max_output_len=args.output_len[1],
        )
        workload = build_workload(spec, AutoTokenizer.from_pretrained(model_dir))
        with LLM(
            model_dir, dtype=args.dtype, device="cpu", max_model_len=workload.max_seq_len
        ) as llm:
            # Warm-up on the first request alone: oneDNN and the allocator settle.
            generate_greedy(llm, workload.requests[:1])
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                started = time.perf_counter()
                generate_greedy(llm, workload.requests)
                wall_seconds = time.perf_counter() - started

    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    operators = [
        {
            "name": e.key,
            "self_cpu_seconds": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / total_us,
            "calls": e.count,
        }
        for e in events
    ]
    print(
        f"Workload {spec.kind}: {spec.num_requests} requests, {workload.num_prompt_tokens} prompt "
        f"+ {workload.num_output_tokens} output tokens; profiled wall {wall_seconds:.2f} s, "
        f"self CPU time {total_us / 1e6:.2f} s"
    )
    print(
        format_table(
            ["operator", "self CPU s", "share", "calls"],
            [
                [op["name"], op["self_cpu_seconds"], f"{100 * op['share']:.1f}%", op["calls"]]
                for op in operators[: args.top]
            ],
        )
    )
    report = {
        "machine": machine_info("cpu", args.threads),
        "args": vars(args),
        "workload": {
            **asdict(spec),
            "num_prompt_tokens": workload.num_prompt_tokens,
            "num_output_tokens": workload.num_output_tokens,
        },
        "wall_seconds": wall_seconds,
        "operators": operators,
    }
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
