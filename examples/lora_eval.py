"""Score several LoRA adapters (and the base model) on one question set, in one batch.

Each question runs once under every adapter and once under the base model; all of those
requests go to one `generate` call, which serves any mix of adapters in the same continuous
batch (`max_loras` of them at a time). A question counts as answered when the reference
answer appears in the completion.

    python examples/lora_eval.py --adapter sql=adapters/sql --adapter chat=adapters/chat
    python examples/lora_eval.py --model path/to/base --adapter a=dir_a --max-tokens 16

Adapters are directories in PEFT's format (what ``peft_model.save_pretrained`` writes) for
the base model given with ``--model``.
"""

from __future__ import annotations

import argparse
import time

from paged_llm import LLM, SamplingParams
from paged_llm.lora.request import LoRARequest
from paged_llm.model_files import DEFAULT_MODEL

# (question, reference answer)
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("How many days are there in a leap year?", "366"),
    ("What is 12 multiplied by 8?", "96"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("Who wrote 'Romeo and Juliet'?", "Shakespeare"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What is the boiling point of water at sea level in Celsius?", "100"),
]


def adapter(value: str) -> tuple[str, str]:
    name, separator, path = value.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--adapter", type=adapter, action="append", required=True, help="NAME=PATH, repeatable"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()

    adapters: list[LoRARequest | None] = [
        LoRARequest(name, lora_int_id, path)
        for lora_int_id, (name, path) in enumerate(args.adapter, start=1)
    ]
    adapters.append(None)
    llm = LLM(
        args.model,
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
    )
    conversations = [[{"role": "user", "content": question}] for question, _ in QUESTIONS]
    prompts = [llm.render_chat(conversation) for conversation in conversations]
    # Every adapter over every question, in one call.
    requests = [(lora, i) for lora in adapters for i in range(len(QUESTIONS))]
    started = time.perf_counter()
    outputs = llm.generate(
        [prompts[i] for _, i in requests],
        SamplingParams(temperature=0, max_tokens=args.max_tokens),
        use_tqdm=False,
        lora_request=[lora for lora, _ in requests],
    )
    elapsed = time.perf_counter() - started
    for lora in adapters:
        name = "base model" if lora is None else lora.lora_name
        answered = sum(
            QUESTIONS[i][1].lower() in output.outputs[0].text.lower()
            for (other, i), output in zip(requests, outputs, strict=True)
            if other == lora
        )
        print(f"{name}: {answered}/{len(QUESTIONS)} answered")
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    print(
        f"{len(requests)} requests under {len(adapters) - 1} adapters and the base model in "
        f"{elapsed:.1f} s, {num_tokens / elapsed:.1f} output tokens/s."
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
