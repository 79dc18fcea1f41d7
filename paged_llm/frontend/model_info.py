"""What the front end knows of a model beside its weights: its Hugging Face config, the
tokenizer, the chat template, the generation config and its EOS ids, read once from the
model's files. An engine is built from it and an `EngineConfig`, without an `LLM`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from paged_llm.engine_args import EngineArgs
from paged_llm.frontend.chat import read_chat_template
from paged_llm.model_files import resolve_model
from paged_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The fields of generation_config.json that become default SamplingParams, by their names
# there (max_new_tokens becomes max_tokens).
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ModelInfo:
    """A model's files, read: ``model`` as the user named it, ``model_dir`` where it lies."""

    model: str
    model_dir: Path
    hf_config: Any
    # None: the LLM was built with skip_tokenizer_init=True.
    tokenizer: PreTrainedTokenizerBase | None
    # The `LLM`'s chat_template argument, read; None: the tokenizer's.
    chat_template: str | None
    # generation_config.json's values (none under generation_config="vllm"), with
    # override_generation_config over them.
    generation_config: dict[str, Any]
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, args: EngineArgs) -> ModelInfo:
        """Resolve ``args.model`` (a directory, a .gguf file or a cached hub id) and read it."""
        model = args.model
        resolved = resolve_model(
            model,
            revision=args.revision,
            quantization=args.quantization,
            quantize_embeddings=args.quantize_embeddings,
        )
        model_dir = resolved.path
        hf_config = _hf_config(model_dir, args, resolved.from_gguf)
        tokenizer = None
        if not args.skip_tokenizer_init:
            # A conversion's tokenizer is told the config, which it would otherwise read
            # through its class (`_hf_config`).
            known_config = hf_config if resolved.from_gguf and not args.tokenizer else None
            tokenizer = _load_tokenizer(args.tokenizer or model_dir, args, known_config)
            if len(tokenizer) > hf_config.vocab_size:
                logger.warning(
                    "The tokenizer has %d tokens, more than the model's vocabulary of %d: "
                    "the model never produces ids from %d on, and requests naming them (in "
                    "prompts, bad_words or other token-id parameters) are refused.",
                    len(tokenizer),
                    hf_config.vocab_size,
                    hf_config.vocab_size,
                )
        chat_template = read_chat_template(args.chat_template)
        generation_file = _read_generation_config(
            model_dir if args.generation_config in ("auto", "vllm") else args.generation_config
        )
        # As vLLM: "vllm" drops the file's sampling defaults, not its EOS tokens.
        generation_config = {
            **({} if args.generation_config == "vllm" else generation_file),
            **(args.override_generation_config or {}),
        }
        return cls(
            model=str(model),
            model_dir=model_dir,
            hf_config=hf_config,
            tokenizer=tokenizer,
            chat_template=chat_template,
            generation_config=generation_config,
            eos_token_ids=_eos_token_ids(generation_file, hf_config, tokenizer),
        )

    @property
    def vocab_size(self) -> int:
        size: int = self.hf_config.vocab_size
        return size

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values from generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM
        does."""
        generation = self.generation_config
        fields = {
            name: generation[name]
            for name in _SAMPLING_DEFAULTS
            if generation.get(name) is not None
        }
        if generation.get("max_new_tokens") is not None:
            fields["max_tokens"] = generation["max_new_tokens"]
        return SamplingParams(**fields)


def _hf_config(model_dir: Path, args: EngineArgs, whole: bool) -> Any:
    """The model's Hugging Face config with ``hf_overrides`` applied. A config.json that
    holds every field (``whole``: a GGUF conversion's) is read as transformers' base
    config class: the model's own class would add only defaults and checks, and
    transformers 5.25's `LlamaConfig` imports its model-loading stack on first use
    (torch.distributed.tensor, sympy, accelerate: 64 MiB and 0.6 s of every start)."""
    if whole:
        hf_config = PretrainedConfig.from_json_file(model_dir / "config.json")
    else:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    overrides = args.hf_overrides
    if callable(overrides):
        return overrides(hf_config)
    for name, value in (overrides or {}).items():
        setattr(hf_config, name, value)
    return hf_config


# What transformers reads a tokenizer from, in a model folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def _load_tokenizer(
    source: str | Path, args: EngineArgs, config: PretrainedConfig | None
) -> PreTrainedTokenizerBase:
    """The tokenizer of ``source``, or a ValueError naming it and the files looked for;
    ``config``: the model's, where already read (else transformers reads it)."""
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            source,
            config=config,
            trust_remote_code=args.trust_remote_code,
            revision=args.tokenizer_revision,
            use_fast=args.tokenizer_mode != "slow",
        )
    except (OSError, ValueError) as error:
        found = [name for name in _TOKENIZER_FILES if (Path(source) / name).is_file()]
        raise ValueError(
            f"No tokenizer could be loaded from {source}: looked for "
            f"{', '.join(_TOKENIZER_FILES)}; found {', '.join(found) or 'none of them'} "
            f"({type(error).__name__}: {str(error).splitlines()[0]}). Add the model's "
            "tokenizer files, pass "
            "tokenizer=<folder>, or skip_tokenizer_init=True to run on token ids."
        ) from error
    return tokenizer


def _read_generation_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "generation_config.json"
    if path.exists():
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    if not Path(folder).is_dir():
        raise ValueError(
            f"LLM argument generation_config={str(folder)!r} must be 'auto', 'vllm' or a "
            "folder holding generation_config.json; no such folder."
        )
    return {}


def _eos_token_ids(
    generation_config: dict[str, Any],
    hf_config: Any,
    tokenizer: PreTrainedTokenizerBase | None,
) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer, or the
    model config where there is no tokenizer."""
    eos: set[int] = set()
    for ids in (
        generation_config.get("eos_token_id"),
        getattr(hf_config, "eos_token_id", None) if tokenizer is None else None,
        tokenizer.eos_token_id if tokenizer is not None else None,
    ):
        eos.update(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    return frozenset(eos)
