"""N-gram speculative decoding: paged_llm with and without it, on a copy-heavy and a
free-form workload, at several batch sizes, in one run.

Each cell is ``B`` requests submitted together (batch size ``B``), greedy, EOS ignored,
``--output-len`` tokens each, run three ways in fresh subprocesses: without speculation,
with ``--speculative ngram:K`` under the adaptive rule (the default), and with the rule off
(every step drafts up to K tokens: what the rule protects against). The table gives output
tokens per second, each speculating run's speed against the run without, the share of
draft tokens accepted, the tokens a draft step emits on average (accepted + 1), and whether
the tokens equal the run without speculation.

Run from the repository root:
    python -m benchmarks.speculative
    python -m benchmarks.speculative --speculative ngram:4 --batch-sizes 1,4 --workloads copy
"""

from __future__ import annotations

import argparse
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.engines import EngineOptions, EngineRun, run_engine_in_subprocess
from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    resolve_benchmark_model,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.workloads import WORKLOAD_KINDS, WorkloadSpec, build_workload

_SPECULATIVE_RE = re.compile(r"ngram:(\d+)")


def speculative_config(text: str) -> dict[str, Any]:
    """``"ngram:K"`` -> LLM's ``speculative_config`` with K draft tokens and n-grams of 2
    to 4 tokens."""
    match = _SPECULATIVE_RE.fullmatch(text)
    if match is None or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected ngram:K with K >= 1, got {text!r}")
    return {
        "method": "ngram",
        "num_speculative_tokens": int(match.group(1)),
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--speculative", type=speculative_config, default="ngram:4")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--workloads", default="copy,b", help=f"of {', '.join(WORKLOAD_KINDS)}")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    args.workloads = args.workloads.split(",")
    unknown = [kind for kind in args.workloads if kind not in WORKLOAD_KINDS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {WORKLOAD_KINDS}")
    resolve_device_arguments(args)
    return args


def cell(workload: str, batch_size: int, runs: dict[str, EngineRun]) -> dict[str, Any]:
    """One row: each run's output tokens per second and the speculating runs' figures."""
    plain = runs["off"]
    row: dict[str, Any] = {"workload": workload, "batch_size": batch_size}
    num_tokens = sum(map(len, plain.output_token_ids))
    for label, run in runs.items():
        row[f"{label}_tok_per_s"] = num_tokens / run.wall_seconds
        if label == "off":
            continue
        row[f"{label}_speedup"] = plain.wall_seconds / run.wall_seconds
        row[f"{label}_identical"] = run.output_token_ids == plain.output_token_ids
        drafted, accepted = run.num_draft_tokens or 0, run.num_accepted_tokens or 0
        row[f"{label}_acceptance"] = accepted / drafted if drafted else None
        row[f"{label}_tokens_per_draft"] = (
            (accepted + run.num_drafts) / run.num_drafts if run.num_drafts else None
        )
        row[f"{label}_draft_tokens"] = drafted
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = machine_info(args.device, args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="paged_llm_bench_") as tmp:
        work_dir = Path(tmp)
        model_dir = resolve_benchmark_model(
            args.model, args.random_weights_config, getattr(torch, args.dtype), work_dir
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for kind in args.workloads:
            for batch_size in args.batch_sizes:
                spec = WorkloadSpec(
                    kind=kind,
                    num_requests=batch_size,
                    seed=args.seed,
                    min_output_len=args.output_len,
                    max_output_len=args.output_len,
                )
                workload = build_workload(spec, tokenizer)
                options = EngineOptions(
                    model_dir=str(model_dir),
                    dtype=args.dtype,
                    device=args.device,
                    threads=args.threads,
                    max_model_len=workload.max_seq_len,
                    max_num_seqs=batch_size,
                )
                variants = {
                    "off": options,
                    "adaptive": replace(options, speculative_config=args.speculative),
                    "always": replace(
                        options, speculative_config={**args.speculative, "adaptive": False}
                    ),
                }
                runs = {
                    label: run_engine_in_subprocess("paged_llm", variant, workload, work_dir)
                    for label, variant in variants.items()
                }
                rows.append(cell(kind, batch_size, runs))
                print_rows(rows[-1:])
    k = args.speculative["num_speculative_tokens"]
    print(f"\n{machine_line(machine, args.device, args.dtype)}")
    print(f"ngram:{k} (n-grams of 2 to 4 tokens), {args.output_len} output tokens per request")
    print_rows(rows)
    result = {"benchmark": "speculative", "machine": machine, "args": vars(args), "rows": rows}
    if args.out is not None:
        write_json(args.out, result)
    return result


def print_rows(rows: list[dict[str, Any]]) -> None:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    print(
        format_table(
            [
                "workload",
                "batch",
                "off tok/s",
                "adaptive tok/s",
                "adaptive",
                "always tok/s",
                "always",
                "accepted",
                "tokens/draft",
                "same tokens",
            ],
            [
                [
                    row["workload"],
                    row["batch_size"],
                    f"{row['off_tok_per_s']:.1f}",
                    f"{row['adaptive_tok_per_s']:.1f}",
                    ratio(row["adaptive_speedup"]),
                    f"{row['always_tok_per_s']:.1f}",
                    ratio(row["always_speedup"]),
                    share(row["always_acceptance"]),
                    "-"
                    if row["always_tokens_per_draft"] is None
                    else f"{row['always_tokens_per_draft']:.2f}",
                    "yes" if row["adaptive_identical"] and row["always_identical"] else "NO",
                ]
                for row in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
