"""Seeded benchmark workloads: lists of (prompt token ids, number of tokens to generate).

Every engine gets the same token ids and generates exactly ``max_tokens`` tokens per
request (EOS ignored), so their outputs and timings compare one to one.

Shapes:
    a: nano-vllm's workload: random token ids, input and output lengths uniform in a range.
    b: real chat prompts (`benchmarks.prompts.USER_PROMPTS`) rendered with the model's chat
       template, output lengths uniform in a range.
    c: as b, with the same long system prompt in front of every request, so that prefix
       caching has something to share.
    copy: copy-heavy chat prompts (speculative decoding's case): a list of records behind an
       instruction to return it whole, copied, corrected or lightly reformatted
       (`copy_task_prompts`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from transformers import PreTrainedTokenizerBase

from benchmarks.prompts import SHARED_SYSTEM_PROMPT, USER_PROMPTS

WORKLOAD_KINDS = ("a", "b", "c", "copy")

# The copy workload: an instruction that asks for a list back, whole, copied, corrected or
# lightly reformatted, and a seeded list of `COPY_LIST_LENGTH` inventory records.
COPY_INSTRUCTIONS = (
    "Copy this inventory list exactly.",
    "Correct the spelling of the fruit names in this list. Return the whole list in the "
    "same order, nothing else.",
    "Rewrite this list replacing 'kg' with 'kilograms'. Keep everything else the same.",
    "Return this list in the same order, with the first letter of each fruit capitalized. "
    "Output only the list.",
)
COPY_LIST_LENGTH = 15
_FRUITS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "orange",
    "peach",
    "pear",
    "plum",
    "kiwi",
    "melon",
    "lime",
    "fig",
    "date",
    "apricot",
    "papaya",
    "guava",
]
_COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "brown", "pink"]

# nano-vllm draws prompt token ids below 10,000: ordinary tokens of any vocabulary.
RANDOM_TOKEN_ID_LIMIT = 10_000


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; the same spec and seed always give the same requests."""

    kind: str
    num_requests: int
    seed: int = 0
    # Workload a only: prompt lengths are drawn from [min_input_len, max_input_len].
    min_input_len: int = 32
    max_input_len: int = 256
    min_output_len: int = 16
    max_output_len: int = 128

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload kind must be one of {WORKLOAD_KINDS}, got {self.kind!r}.")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}.")
        for low, high, name in (
            (self.min_input_len, self.max_input_len, "input"),
            (self.min_output_len, self.max_output_len, "output"),
        ):
            if not 1 <= low <= high:
                raise ValueError(
                    f"{name} lengths must satisfy 1 <= min <= max, got [{low}, {high}]."
                )


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt and exactly how many tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output of any request: what the KV cache must hold per sequence."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        return cls(
            spec=WorkloadSpec(**data["spec"]),
            requests=[BenchRequest(**r) for r in data["requests"]],
        )


def chat_prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, user_prompt: str, system_prompt: str | None
) -> list[int]:
    """The token ids of one user turn rendered with the model's chat template, as
    `LLM.render_chat` makes them."""
    conversation = [{"role": "user", "content": user_prompt}]
    if system_prompt is not None:
        conversation.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_workload(spec: WorkloadSpec, tokenizer: PreTrainedTokenizerBase) -> Workload:
    """Draw the requests of ``spec`` with its seed."""
    rng = random.Random(spec.seed)
    if spec.kind == "a":
        vocab_limit = min(RANDOM_TOKEN_ID_LIMIT, len(tokenizer))
        prompts = [
            [
                rng.randrange(vocab_limit)
                for _ in range(rng.randint(spec.min_input_len, spec.max_input_len))
            ]
            for _ in range(spec.num_requests)
        ]
    elif spec.kind == "copy":
        prompts = [
            chat_prompt_token_ids(tokenizer, text, None)
            for text in copy_task_prompts(spec.num_requests, rng)
        ]
    else:
        system_prompt = SHARED_SYSTEM_PROMPT if spec.kind == "c" else None
        # Each prompt is used once before any repeats, so up to len(USER_PROMPTS) requests
        # share nothing but the template (and, in c, the system prompt).
        order: list[str] = []
        while len(order) < spec.num_requests:
            order.extend(rng.sample(USER_PROMPTS, len(USER_PROMPTS)))
        prompts = [
            chat_prompt_token_ids(tokenizer, text, system_prompt)
            for text in order[: spec.num_requests]
        ]
    requests = [
        BenchRequest(prompt, rng.randint(spec.min_output_len, spec.max_output_len))
        for prompt in prompts
    ]
    return Workload(spec, requests)


def copy_task_prompts(num_prompts: int, rng: random.Random) -> list[str]:
    """Copy-heavy user prompts: an instruction of `COPY_INSTRUCTIONS` and a list of
    inventory records ("3. green mango, 12 kg, $4.07"), one fruit name in five misspelled
    (two letters swapped)."""
    prompts = []
    for _ in range(num_prompts):
        records = []
        for number in range(1, COPY_LIST_LENGTH + 1):
            fruit = rng.choice(_FRUITS)
            if rng.random() < 0.2:
                fruit = fruit[0] + fruit[2] + fruit[1] + fruit[3:]
            price = f"${rng.randint(1, 99)}.{rng.randint(0, 99):02d}"
            records.append(
                f"{number}. {rng.choice(_COLORS)} {fruit}, {rng.randint(1, 20)} kg, {price}"
            )
        instruction = COPY_INSTRUCTIONS[rng.randrange(len(COPY_INSTRUCTIONS))]
        prompts.append(f"{instruction}\n\n" + "\n".join(records))
    return prompts


def random_token_requests(
    num_requests: int, input_len: int, output_len: int, seed: int, vocab_limit: int
) -> list[BenchRequest]:
    """Requests of fixed lengths with random prompt tokens (latency runs and warm-ups)."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(vocab_limit) for _ in range(input_len)], output_len)
        for _ in range(num_requests)
    ]
