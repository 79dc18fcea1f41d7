"""A tokenizer with added tokens past the model's vocabulary: said at load time, and every
request naming such an id is refused alone, whatever parameter carries it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from paged_llm import LLM, SamplingParams

ADDED = ["zqxfoo", "zqxbar"]


@pytest.fixture(scope="module")
def wide_tokenizer_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (vocabulary 49152) with a tokenizer of 49154 tokens."""
    path = tmp_path_factory.mktemp("wide-tokenizer") / "model"
    shutil.copytree(llama_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(ADDED)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.usefixtures("one_thread")
def test_ids_past_the_models_vocabulary_are_refused_per_request(
    wide_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="paged_llm.frontend.model_info"):
        llm = LLM(wide_tokenizer_dir, max_model_len=64)
    with llm:
        assert "The tokenizer has 49154 tokens, more than the model's vocabulary of 49152" in (
            caplog.text
        )
        greedy = SamplingParams(temperature=0, max_tokens=4)
        params = [
            greedy,
            SamplingParams(temperature=0, max_tokens=4, bad_words=["zqxfoo"]),
            greedy,
            SamplingParams(temperature=0, max_tokens=4, bad_words=["ocean"]),
        ]
        prompts = ["Hello", "Hello", "Say zqxbar", "Hello"]
        outputs = llm.generate(prompts, params, use_tqdm=False, on_error="skip")
        assert [len(o.outputs) for o in outputs] == [1, 0, 0, 1]
        assert outputs[1].error_parameter == "bad_words"
        assert outputs[1].error is not None
        assert "bad word 'zqxfoo' has token id 49152" in outputs[1].error
        assert "[0, 49152)" in outputs[1].error
        assert outputs[2].error_parameter == "prompt_token_ids"
        assert outputs[2].error is not None and "outside the vocabulary" in outputs[2].error
