"""What `LLM(batch_invariant=True)` costs and what it buys, on one seeded sampled workload.

Both engines live in this process and run the workload in alternation, several rounds, so
a change in the machine's load hits both alike; the ratio of their median wall times is
the cost. Each round also runs the workload a second time on the same engine, when its
prompts' prefixes come from the prefix cache, and counts the requests whose sampled
tokens changed: what the default path loses in reproducibility and the switch keeps.

Run from the repository root:
    python -m benchmarks.batch_invariance --workload b --num-requests 32
"""

from __future__ import annotations

import argparse
import statistics
import time

from transformers import AutoTokenizer

from benchmarks.workloads import WORKLOAD_KINDS, Workload, WorkloadSpec, build_workload
from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL, resolve_model


def _sampled_tokens(llm: LLM, workload: Workload) -> tuple[float, list[list[int]]]:
    """Wall seconds and every request's tokens, each request seeded by its index."""
    params = [
        SamplingParams(temperature=0.8, seed=index, max_tokens=r.max_tokens, ignore_eos=True)
        for index, r in enumerate(workload.requests)
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workload", choices=WORKLOAD_KINDS, default="b")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model).path
    workload = build_workload(
        WorkloadSpec(
            args.workload,
            args.num_requests,
            min_output_len=args.output_len[0],
            max_output_len=args.output_len[1],
        ),
        AutoTokenizer.from_pretrained(model_dir),
    )
    settings = {"max_model_len": workload.max_seq_len}
    engines = {
        "default": LLM(model_dir, **settings),
        "batch_invariant=True": LLM(model_dir, batch_invariant=True, **settings),
    }
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    changed: dict[str, int] = dict.fromkeys(engines, 0)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            wall, first = _sampled_tokens(llm, workload)
            # The second run finds every prompt's full blocks in the prefix cache.
            _, second = _sampled_tokens(llm, workload)
            seconds[name].append(wall)
            changed[name] += sum(a != b for a, b in zip(first, second, strict=True))
    for llm in engines.values():
        llm.shutdown()

    num_output = workload.num_output_tokens
    print(
        f"Workload {args.workload}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt + {num_output} output tokens, sampled at "
        f"temperature 0.8 with a seed per request; {args.rounds} alternating rounds."
    )
    print(f"{'engine':<22} {'median wall s':>13} {'out tok/s':>9} {'reruns that changed':>20}")
    for name, walls in seconds.items():
        median = statistics.median(walls)
        reruns = f"{changed[name]} of {args.rounds * len(workload.requests)}"
        print(f"{name:<22} {median:>13.2f} {num_output / median:>9.1f} {reruns:>20}")
    cost = statistics.median(seconds["batch_invariant=True"]) / statistics.median(
        seconds["default"]
    )
    print(f"batch_invariant=True takes {cost:.2f}x the default's wall time.")


if __name__ == "__main__":
    main()
