"""Dataset generation on a Ray cluster with `paged_llm.ray` (needs the [ray] extra).

1. Write a JSONL of {id, question} rows.
2. Read it with Ray Data, answer every question in `--concurrency` engine actors (one `LLM`
   each, built once), and write the answers as JSONL files (one per Ray Data write task).
3. Read the answers back: every question is answered exactly once.

    ray start --head                                   # on the head node
    ray start --address HEAD_IP:6379                   # on each worker node
    python examples/ray_dataset_generation.py --address auto --concurrency 4

Without --address, Ray starts a one-node cluster in this process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import ray.data

from paged_llm.model_files import DEFAULT_MODEL
from paged_llm.ray import ProcessorConfig, build_processor

TOPICS = ["tides", "rainbows", "volcanoes", "glaciers", "comets", "coral reefs", "auroras"]


def write_questions(path: Path, num_rows: int) -> None:
    with open(path, "w", encoding="utf-8") as sink:
        for i in range(num_rows):
            question = f"In two sentences, explain {TOPICS[i % len(TOPICS)]} to a child."
            sink.write(json.dumps({"id": i, "question": question}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a Ray cluster ('auto': the one `ray start` began)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-rows", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=2, help="engine actors")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per actor call")
    parser.add_argument("--workdir", type=Path, help="default: a temporary folder")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ray_dataset_generation_"))
    questions, answers = workdir / "questions.jsonl", workdir / "answers"
    write_questions(questions, args.num_rows)

    config = ProcessorConfig(
        model_source=args.model,
        engine_kwargs={"max_model_len": args.max_model_len},  # any LLM(...) keyword
        concurrency=args.concurrency,
        batch_size=args.batch_size,
    )

    def preprocess(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "messages": [{"role": "user", "content": row["question"]}],
            "sampling_params": {
                "temperature": 0.3,
                "max_tokens": args.max_tokens,
                "seed": row["id"],
            },
        }

    def postprocess(row: dict[str, Any]) -> dict[str, Any]:
        return {"id": row["id"], "answer": row["generated_text"], "error": row["error"]}

    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    ray.init(address=args.address)
    try:
        started = time.perf_counter()
        # NOTE: reading and writing take no CPU: on CPU-only nodes the engine actors may
        # hold them all, and a read waiting for one would wait for ever.
        dataset = ray.data.read_json(str(questions), num_cpus=0)
        processor(dataset).write_json(str(answers), ray_remote_args={"num_cpus": 0})
        seconds = time.perf_counter() - started
    finally:
        ray.shutdown()

    rows = [json.loads(line) for file in answers.glob("*.json") for line in file.open()]
    ids = sorted(row["id"] for row in rows)
    errors = [row for row in rows if row["error"] is not None]
    for row in sorted(rows, key=lambda row: row["id"])[:3]:
        print(f"{row['id']}: {row['answer']!r}")
    print(f"Answered {len(rows)} questions in {seconds:.1f} s on {args.concurrency} actors.")
    if ids != list(range(args.num_rows)):
        raise SystemExit(f"{answers} does not hold each of the {args.num_rows} ids once: {ids}")
    print(f"{answers} holds all {args.num_rows} ids, each exactly once; {len(errors)} errors.")


if __name__ == "__main__":
    main()
