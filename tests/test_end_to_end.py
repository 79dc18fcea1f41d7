"""The real embedded model, SmolLM2-135M-Instruct, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL, resolve_model
from tests.conftest import hf_greedy, smollm2_gguf_path

# The real model: loads and generates for seconds, so out of quick `-m 'not slow'` runs.
pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain in one sentence what photosynthesis is.",
    "What is 12 times 12?",
    "Give me a tip for learning to play the guitar.",
    "Who wrote Romeo and Juliet?",
]
MAX_TOKENS = 32
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(DEFAULT_MODEL).path


def test_greedy_chat_equals_transformers(llm: LLM, model_dir: Path) -> None:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)

    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for output in outputs:
        completion = output.outputs[0]
        expected = hf_greedy(reference.eval(), output.prompt_token_ids, MAX_TOKENS)
        # transformers was told to ignore EOS; ours stops at it, so compare up to our end.
        assert completion.token_ids == expected[: len(completion.token_ids)]
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] in llm.eos_token_ids
    assert "Paris" in outputs[0].outputs[0].text


def test_gguf_file_gives_the_same_model(llm: LLM) -> None:
    # The module's model came from the hub id; the GGUF file itself must load the same one
    # (the conversion cache and its reuse are tested in tests/model_files/test_smollm2.py).
    conversation = [{"role": "user", "content": QUESTIONS[0]}]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(smollm2_gguf_path()), max_model_len=256) as other:
        assert other.chat(conversation, params, use_tqdm=False)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-n4"])
def test_chat_replies_follow_schemas_regexes_and_choices(llm: LLM, sampled: bool) -> None:
    from tests.test_structured_outputs import CONSTRAINTS

    # Every third constraint: schemas, regexes and choices, each once.
    chosen = CONSTRAINTS[::3]
    conversations = [
        [
            {
                "role": "user",
                "content": f"{QUESTIONS[i % len(QUESTIONS)]} Answer in the format asked.",
            }
        ]
        for i in range(len(chosen))
    ]
    base = {"n": 4, "temperature": 1.0, "seed": 3} if sampled else {"temperature": 0}
    params = [
        SamplingParams(**base, max_tokens=96, structured_outputs=constraint)
        for constraint, _ in chosen
    ]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    stopped = 0
    for output, (_, check) in zip(outputs, chosen, strict=True):
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                stopped += 1
                assert check(completion.text), completion.text
    assert stopped >= 0.8 * sum(len(o.outputs) for o in outputs)
