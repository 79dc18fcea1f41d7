"""Drop near-duplicate rows of a JSONL dataset by the cosine similarity of their embeddings.

Every row's text is embedded with the model as a pooling model (``runner="pooling"``: the
last token's hidden state, L2-normalized); rows are then kept in order, each unless its
cosine similarity to a row already kept is above ``--threshold``. Without ``--input`` the
example makes a small dataset of its own with planted duplicates (repeats, case and spacing
changes) and says how many of them it dropped. The embedded SmolLM2 is a language model, not
one trained to embed: it finds the planted duplicates and some sentences that only share
words too; point ``--model`` at an embedding model (a decoder trained for last-token
embeddings) for real use.

    python examples/dedup_by_embedding.py
    python examples/dedup_by_embedding.py --input rows.jsonl --field text --output kept.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np

from paged_llm import LLM
from paged_llm.model_files import DEFAULT_MODEL

SUBJECTS = ["The cat", "A small robot", "My neighbour", "The river", "An old train", "The chef"]
VERBS = ["watches", "builds", "paints", "follows", "forgets", "cooks"]
OBJECTS = ["the moon", "a paper boat", "the morning news", "a quiet song", "the last bus"]


def make_dataset(num_rows: int, seed: int) -> list[dict[str, object]]:
    """``num_rows`` rows ``{"id", "text", "copy_of"}``: sentences, about one in four a
    near-duplicate of an earlier one (``copy_of`` its id; None for an original)."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for row_id in range(num_rows):
        originals = [row for row in rows if row["copy_of"] is None]
        if originals and rng.random() < 0.25:
            source = rng.choice(originals)
            text = str(source["text"])
            text = rng.choice([text, text.lower(), f"  {text}", text.rstrip(".") + " ."])
            rows.append({"id": row_id, "text": text, "copy_of": source["id"]})
            continue
        text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} on day {row_id}."
        rows.append({"id": row_id, "text": text, "copy_of": None})
    return rows


def near_duplicates(vectors: np.ndarray, threshold: float) -> list[int | None]:
    """For each row, the earlier kept row it duplicates (cosine above ``threshold``), or
    None if it is kept. ``vectors`` are L2-normalized, so a dot product is a cosine."""
    kept: list[int] = []
    duplicate_of: list[int | None] = []
    for index, vector in enumerate(vectors):
        similarity = vectors[kept] @ vector if kept else np.empty(0)
        best = int(np.argmax(similarity)) if len(similarity) else -1
        if best >= 0 and similarity[best] > threshold:
            duplicate_of.append(kept[best])
        else:
            duplicate_of.append(None)
            kept.append(index)
    return duplicate_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--input", type=Path, help="JSONL rows (default: a generated dataset)")
    parser.add_argument("--field", default="text", help="the field of a row to embed")
    parser.add_argument("--output", type=Path, help="JSONL of the kept rows (default: temp)")
    parser.add_argument("--threshold", type=float, default=0.98)
    parser.add_argument("--num-rows", type=int, default=64, help="rows of the generated dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pooling-type",
        default="LAST",
        choices=("LAST", "MEAN"),
        help="the last token's hidden state (as embedding models built on a decoder, such as "
        "Qwen3-Embedding, are trained) or the mean over the text",
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()

    if args.input is None:
        rows = make_dataset(args.num_rows, args.seed)
    else:
        rows = [json.loads(line) for line in args.input.read_text().splitlines() if line.strip()]
    llm = LLM(
        args.model,
        runner="pooling",
        pooler_config={"pooling_type": args.pooling_type},
        max_model_len=args.max_model_len,
    )
    outputs = llm.embed([str(row[args.field]) for row in rows], use_tqdm=False)
    vectors = np.array([output.outputs.embedding for output in outputs], dtype=np.float32)
    duplicate_of = near_duplicates(vectors, args.threshold)
    kept = [row for row, original in zip(rows, duplicate_of, strict=True) if original is None]

    output = args.output or Path(tempfile.mkdtemp(prefix="paged_llm_dedup_")) / "kept.jsonl"
    with open(output, "w", encoding="utf-8") as sink:
        for row in kept:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(
        f"Embedded {len(rows)} rows ({vectors.shape[1]} dimensions); kept {len(kept)}, dropped "
        f"{len(rows) - len(kept)} with a cosine similarity above {args.threshold} to a kept row."
    )
    for row, original in zip(rows, duplicate_of, strict=True):
        if original is not None:
            print(f"  dropped {row['id']}: {row[args.field]!r} ~ {rows[original][args.field]!r}")
    if args.input is None:
        planted = sum(row["copy_of"] is not None for row in rows)
        caught = sum(
            row["copy_of"] is not None and original is not None
            for row, original in zip(rows, duplicate_of, strict=True)
        )
        print(f"Planted duplicates dropped: {caught} of {planted}.")
    print(f"Wrote the kept rows to {output}")


if __name__ == "__main__":
    main()
