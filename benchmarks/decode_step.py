"""Decode step time against the memory-bandwidth roofline.

A decode step reads every weight once and every running sequence's KV cache once, and
does little arithmetic per byte, so its floor is (weight bytes + KV bytes) / bandwidth.
For each batch size this prefills that many random prompts of ``--context-len`` tokens,
then times ``--steps`` decode-only steps (CUDA graphs on a GPU, unless
``--enforce-eager``) and prints measured and roofline milliseconds per step.

Run from the repository root:
    python -m benchmarks.decode_step --device cuda --random-weights-config llama-3.2-1b
    python -m benchmarks.decode_step --batch-sizes 1,16,64 --context-len 256
    python -m benchmarks.decode_step --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.engines import greedy_params, synchronize
from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    resolve_benchmark_model,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, write_json
from paged_llm import LLM
from paged_llm.engine.request import EngineRequest

# HBM3e bandwidth of an H200 by the vendor's datasheet.
H200_BANDWIDTH_GBPS = 4800.0


@dataclass
class StepResult:
    batch_size: int
    context_len: int
    ms_per_step: float
    weight_bytes: int
    kv_bytes: int
    roofline_ms: float

    @property
    def fraction_of_roofline(self) -> float:
        return self.roofline_ms / self.ms_per_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", help='"auto", "fp8", "fp8_e5m2"')
    parser.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="memory bandwidth of the roofline (default: 4800 on cuda, measured on cpu)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    resolve_device_arguments(args)
    return args


def measured_cpu_bandwidth_gbps() -> float:
    """Read bandwidth of a large reduction: what streaming a KV cache can reach."""
    data = torch.ones(256 * 2**20 // 4)
    data.sum()
    started = time.perf_counter()
    for _ in range(5):
        data.sum()
    return 5 * data.numel() * 4 / (time.perf_counter() - started) / 1e9


def time_decode(llm: LLM, batch_size: int, context_len: int, steps: int, device: str) -> float:
    """Seconds per decode-only step with ``batch_size`` sequences of ``context_len`` tokens."""
    engine = llm.engine
    assert engine is not None
    generator = torch.Generator().manual_seed(batch_size)
    params = greedy_params(steps + 8)
    for i in range(batch_size):
        prompt = torch.randint(100, 20000, (context_len,), generator=generator).tolist()
        engine.add_request(EngineRequest(f"decode-{batch_size}-{i}", None, prompt, params))
    # Prefill (and the first sampled token of each sequence), then a few warm-up decodes.
    while engine.scheduler.waiting or any(
        seq.num_output_tokens == 0 for seq in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(device)
    seconds = (time.perf_counter() - started) / steps
    engine.abort_all()
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    bandwidth = args.bandwidth_gbps or (
        H200_BANDWIDTH_GBPS if args.device == "cuda" else measured_cpu_bandwidth_gbps()
    )
    with tempfile.TemporaryDirectory(prefix="paged_llm_decode_") as tmp:
        model_dir = resolve_benchmark_model(
            args.model, args.random_weights_config, dtype, Path(tmp)
        )
        with LLM(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.context_len + args.steps + 16,
            max_num_seqs=max(batch_sizes),
            enforce_eager=args.enforce_eager,
            kv_cache_dtype=args.kv_cache_dtype,
        ) as llm:
            runner = llm.engine.model_runner
            # Every linear layer's weight (the LM head's too, tied or not) is read once per
            # step; of the embedding table only the batch's rows are.
            weight_bytes = dtype.itemsize * sum(
                m.in_features * m.out_features
                for m in runner.model.modules()
                if isinstance(m, torch.nn.Linear)
            )
            results = []
            for batch_size in batch_sizes:
                seconds = time_decode(llm, batch_size, args.context_len, args.steps, args.device)
                # Mid-measurement, each sequence holds about this many tokens.
                context = args.context_len + args.steps // 2 + 4
                kv_bytes = batch_size * context * runner.kv_bytes_per_token
                results.append(
                    StepResult(
                        batch_size=batch_size,
                        context_len=args.context_len,
                        ms_per_step=1e3 * seconds,
                        weight_bytes=weight_bytes,
                        kv_bytes=kv_bytes,
                        roofline_ms=1e3 * (weight_bytes + kv_bytes) / (bandwidth * 1e9),
                    )
                )
    print(
        f"Decode steps, {args.device} {args.dtype}, context {args.context_len} tokens, "
        f"bandwidth {bandwidth:,.0f} GB/s{' (measured)' if args.bandwidth_gbps is None and args.device == 'cpu' else ''}"
    )
    print(
        format_table(
            ["batch", "ms/step", "roofline ms", "of roofline", "weights MiB", "KV MiB", "tok/s"],
            [
                [
                    r.batch_size,
                    r.ms_per_step,
                    r.roofline_ms,
                    f"{100 * r.fraction_of_roofline:.0f}%",
                    r.weight_bytes / 2**20,
                    r.kv_bytes / 2**20,
                    r.batch_size / r.ms_per_step * 1e3,
                ]
                for r in results
            ],
        )
    )
    report = {
        "machine": machine_info(args.device, args.threads),
        "args": vars(args),
        "bandwidth_gbps": bandwidth,
        "results": [{**asdict(r), "fraction_of_roofline": r.fraction_of_roofline} for r in results],
    }
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
