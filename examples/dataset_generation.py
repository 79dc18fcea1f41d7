"""Dataset generation with the `paged-llm` CLI, including a crash and a resume.

1. Write an input JSONL of {id, prompt} and {id, messages} rows.
2. Run `paged-llm generate` on it and kill it with SIGKILL part-way, as a crash would.
3. Run it again with --resume: rows already written are skipped, a torn last line is
   repaired (if the kill left one), and the rest are generated. Every id ends up in the
   output exactly once.

    python examples/dataset_generation.py
    python examples/dataset_generation.py --num-rows 8 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paged_llm.model_files import DEFAULT_MODEL

PRODUCTS = [
    "a waterproof hiking jacket",
    "a stainless-steel water bottle",
    "a solar-powered phone charger",
    "a lightweight camping hammock",
    "a pair of noise-cancelling headphones",
    "a cast-iron frying pan",
    "a foldable electric bicycle",
    "a set of bamboo toothbrushes",
]


def write_input(path: Path, num_rows: int) -> None:
    with open(path, "w", encoding="utf-8") as sink:
        for i in range(num_rows):
            product = PRODUCTS[i % len(PRODUCTS)]
            if i % 2 == 0:
                row = {"id": f"ad-{i}", "prompt": f"A one-sentence advertisement for {product}:"}
            else:
                question = f"Write a short, friendly product description for {product}."
                row = {"id": f"chat-{i}", "messages": [{"role": "user", "content": question}]}
            sink.write(json.dumps(row) + "\n")


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-rows", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--workdir", type=Path, help="where to write the files (default: a temp dir)"
    )
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="paged_llm_dataset_"))
    workdir.mkdir(parents=True, exist_ok=True)
    input_path, output_path = workdir / "prompts.jsonl", workdir / "completions.jsonl"
    output_path.unlink(missing_ok=True)
    write_input(input_path, args.num_rows)
    print(f"Wrote {args.num_rows} rows to {input_path}")

    command = [
        sys.executable, "-m", "paged_llm", "generate",
        "--model", args.model,
        "--input", str(input_path),
        "--output", str(output_path),
        "--max-model-len", str(args.max_model_len),
        "--max-tokens", str(args.max_tokens),
        "--temperature", "0.7",
        "--seed", "1234",
        # A few sequences at a time, so that rows finish (and are written) gradually.
        "--max-num-seqs", "4",
        "--no-progress",
    ]  # fmt: skip
    print("$", " ".join(command))
    job = subprocess.Popen(command)
    kill_after = max(1, args.num_rows // 3)
    while job.poll() is None and count_lines(output_path) < kill_after:
        time.sleep(0.02)
    if job.poll() is None:
        job.send_signal(signal.SIGKILL)
        job.wait()
        print(f"Killed the job (SIGKILL) with {count_lines(output_path)} rows written.")
    else:
        print("The job finished before it could be killed; the resume below has nothing to do.")

    print("$", " ".join([*command, "--resume"]))
    subprocess.run([*command, "--resume"], check=True)

    rows = [json.loads(line) for line in output_path.read_text(encoding="utf-8").splitlines()]
    ids = [row["id"] for row in rows]
    assert sorted(ids) == sorted(
        f"{'ad' if i % 2 == 0 else 'chat'}-{i}" for i in range(args.num_rows)
    )
    print(f"{output_path} holds all {len(set(ids))} ids, each exactly once. A few rows:")
    for row in rows[:3]:
        print(json.dumps(row, ensure_ascii=False))


if __name__ == "__main__":
    main()
