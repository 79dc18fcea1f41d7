"""A dataset of schema-valid JSON records, generated with structured outputs.

Each product gets a chat request whose reply is constrained to a JSON schema (needs the
``structured`` extra: pip install "paged_llm[structured]"). Replies that finish with "stop"
follow the schema and are written to a JSONL file; a reply cut by max_tokens ("length") may
be incomplete JSON and is counted, not written.

    python examples/structured_dataset.py
    python examples/structured_dataset.py --num-records 8 --output records.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from paged_llm import LLM, SamplingParams, StructuredOutputsParams
from paged_llm.model_files import DEFAULT_MODEL

PRODUCTS = [
    "a waterproof hiking jacket",
    "a stainless-steel water bottle",
    "a solar-powered phone charger",
    "a lightweight camping hammock",
    "a pair of noise-cancelling headphones",
    "a cast-iron frying pan",
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "category": {"enum": ["outdoor", "kitchen", "electronics", "other"]},
        "price_usd": {"type": "integer", "minimum": 1, "maximum": 2000},
        "features": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "category", "price_usd", "features"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-records", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--output", type=Path, help="JSONL to write (default: a temp file)")
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=args.max_model_len)
    conversations = [
        [
            {
                "role": "user",
                "content": f"Describe {PRODUCTS[i % len(PRODUCTS)]} as a JSON record with its "
                f"name, category, price in dollars and up to three features. Schema: "
                f"{json.dumps(SCHEMA)}",
            }
        ]
        for i in range(args.num_records)
    ]
    params = SamplingParams(
        temperature=0.7,
        seed=1234,
        max_tokens=args.max_tokens,
        # No free whitespace: a small model cannot pad the record with blanks.
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    outputs = llm.chat(conversations, params, use_tqdm=False)

    output = args.output or Path(tempfile.mkdtemp(prefix="paged_llm_structured_")) / "records.jsonl"
    num_cut = 0
    with open(output, "w", encoding="utf-8") as sink:
        for index, result in enumerate(outputs):
            completion = result.outputs[0]
            if completion.finish_reason != "stop":
                num_cut += 1
                continue
            record = json.loads(completion.text)  # valid JSON of the schema: the grammar says so
            sink.write(json.dumps({"id": index, **record}, ensure_ascii=False) + "\n")
    num_written = len(outputs) - num_cut
    print(
        f"Wrote {num_written} schema-valid records to {output}; {num_cut} replies were cut by "
        f"max_tokens={args.max_tokens}."
    )
    for line in output.read_text(encoding="utf-8").splitlines()[:3]:
        print(line)
    llm.shutdown()


if __name__ == "__main__":
    main()
