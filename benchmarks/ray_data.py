"""Ray Data throughput: `paged_llm.ray` on a local multi-node cluster against one `LLM` on the
same rows (needs the [ray] extra).

The same chat rows (greedy, EOS ignored, so every row generates ``--max-tokens``) run
1. through one `LLM` in this process with ``--nodes`` x ``--cpus-per-node`` threads (or
   ``--single-threads``), and
2. through `build_processor` on a `ray.cluster_utils.Cluster` of ``--nodes`` nodes of
   ``--cpus-per-node`` CPUs each (loopback only), one engine actor per node with one thread
   per CPU, so both use the same cores.
Both are timed from the start (model load or actor start-up included) to the last row, and
the generated tokens are compared row by row.

Run from the repository root:
    python -m benchmarks.ray_data --num-rows 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.prompts import USER_PROMPTS
from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[1]


def one_llm(
    model: str, rows: list[dict[str, Any]], params: dict[str, Any], threads: int, max_len: int
) -> tuple[float, list[list[int]]]:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    with LLM(model, max_model_len=max_len) as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": row["question"]}] for row in rows],
            SamplingParams(**params),
            use_tqdm=False,
        )
    return time.perf_counter() - started, [list(output.outputs[0].token_ids) for output in outputs]


def on_cluster(
    model: str,
    rows: list[dict[str, Any]],
    params: dict[str, Any],
    nodes: int,
    cpus_per_node: int,
    batch_size: int,
    max_len: int,
) -> tuple[float, list[list[int]]]:
    # NOTE: before Ray is imported: every node takes the loopback address (see
    # tests/ray/conftest.py), and the workers import this checkout with one thread per CPU.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
    )
    os.environ["OMP_NUM_THREADS"] = str(cpus_per_node)
    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    from paged_llm.ray import ProcessorConfig, build_processor

    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=cpus_per_node, include_dashboard=False)
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        ray.init(address=cluster.address)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        config = ProcessorConfig(
            model,
            {"max_model_len": max_len},
            concurrency=nodes,
            batch_size=batch_size,
            num_cpus_per_actor=cpus_per_node,
        )
        processor = build_processor(
            config,
            preprocess=lambda row: {
                "messages": [{"role": "user", "content": row["question"]}],
                "sampling_params": params,
            },
        )
        started = time.perf_counter()
        results = processor(ray.data.from_items(rows)).take_all()
        seconds = time.perf_counter() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
    by_id = {result["id"]: list(result["generated_token_ids"]) for result in results}
    return seconds, [by_id[row["id"]] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per actor call")
    parser.add_argument(
        "--single-threads",
        type=int,
        help="threads of the one LLM (default: --nodes x --cpus-per-node, the same cores)",
    )
    args = parser.parse_args()
    rows = [
        {"id": i, "question": USER_PROMPTS[i % len(USER_PROMPTS)]} for i in range(args.num_rows)
    ]
    params = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    threads = args.single_threads or args.nodes * args.cpus_per_node
    single_s, single_tokens = one_llm(args.model, rows, params, threads, args.max_model_len)
    cluster_s, cluster_tokens = on_cluster(
        args.model,
        rows,
        params,
        args.nodes,
        args.cpus_per_node,
        args.batch_size,
        args.max_model_len,
    )
    num_tokens = args.num_rows * args.max_tokens
    same = sum(a == b for a, b in zip(single_tokens, cluster_tokens, strict=True))
    print(f"{args.num_rows} rows x {args.max_tokens} tokens")
    print("| engine | wall s (start-up included) | out tok/s | same tokens |")
    print("|---|---:|---:|---:|")
    print(
        f"| one LLM, {threads} threads | {single_s:.1f} | {num_tokens / single_s:.1f} | (reference) |"
    )
    print(
        f"| Ray Data, {args.nodes} nodes x {args.cpus_per_node} CPU, {args.nodes} actors | "
        f"{cluster_s:.1f} | {num_tokens / cluster_s:.1f} | {same}/{args.num_rows} |"
    )


if __name__ == "__main__":
    main()
