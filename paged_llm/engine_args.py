"""`EngineArgs`: every keyword argument of `LLM`, defined once.

Each field carries its default and its documentation. `LLM` takes its keyword arguments
from these fields (an unknown name is a ValueError that names it), `EngineConfig.create`
resolves them, a data-parallel replica is built from the same `EngineArgs`, and the CLI's
engine options are generated from the fields that have a `CliFlag`.

The names, defaults and meanings are vLLM's (``vllm.EngineArgs``), so a script written for
``vllm.LLM`` runs unchanged. A vLLM argument falls in one of three kinds:

- honoured: it does here what it does in vLLM;
- no-op: it tunes something paged_llm does not have (CPU swap space, torch.compile, download
  locations, LoRA sizes); accepted and ignored, and listed as such in docs/usage.md;
- refused unless left at a neutral value: it asks for a feature paged_llm lacks (LoRA,
  quantized weights, pipeline parallelism, ...); any other value is a ValueError that names
  the argument and why, so a script never silently runs without what it asked for.
"""

from __future__ import annotations

import argparse
import difflib
import re
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from paged_llm.layers.quantization import QUANTIZATION_METHODS

# Keys of a field's metadata.
_DOC = "doc"
_KIND = "kind"
# The values a setting accepts, where not all of its type's are; any other is refused.
_ACCEPTS = "accepts"
# The field's CLI flag, a `CliFlag`, where it has one (see `add_cli_arguments`).
_CLI = "cli"


@dataclass(frozen=True)
class CliFlag:
    """How a setting appears on the command line: by default ``--field-name``, its value
    parsed as the field's type (a bool gets ``--name / --no-name``)."""

    names: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None


_FLAG = CliFlag()
# kv_cache_dtype's names (vLLM's) -> the cache's dtype; None: the model's.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512M"``, ``"1e9"`` -> bytes (binary units): the CLI form of
    ``kv_cache_memory_bytes``."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB or 1073741824, got {text!r}")
    try:
        return int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4GiB, got {text!r}") from None


def _honoured(
    default: Any, doc: str, *, cli: CliFlag | None = None, accepts: tuple[Any, ...] = ()
) -> Any:
    return field(
        default=default, metadata={_DOC: doc, _KIND: "honoured", _CLI: cli, _ACCEPTS: accepts}
    )


def _no_op(default: Any, doc: str) -> Any:
    return field(default=default, metadata={_DOC: doc, _KIND: "no-op"})


def _refused_unless(accepts: tuple[Any, ...], doc: str) -> Any:
    return field(default=accepts[0], metadata={_DOC: doc, _KIND: "refused", _ACCEPTS: accepts})


@dataclass(kw_only=True)
class EngineArgs:
    """The settings of an `LLM`, by vLLM's names. See the module docstring for the kinds."""

    # ----- honoured: the model and its tokenizer -------------------------------------------
    tokenizer: str | Path | None = _honoured(
        None, "Where to load the tokenizer from, when not from the model.", cli=_FLAG
    )
    tokenizer_mode: str = _honoured(
        "auto",
        '"auto" (or "hf") loads the fast tokenizer; "slow" asks transformers for the slow '
        'one (use_fast=False). vLLM\'s "mistral" and "custom" tokenizers are not available.',
        accepts=("auto", "hf", "slow"),
    )
    tokenizer_revision: str | None = _honoured(
        None,
        "Branch, tag or commit of a tokenizer given as a hub id in the local Hugging Face "
        "cache; ignored for a local directory.",
    )
    revision: str | None = _honoured(
        None,
        "Branch, tag or commit of a model given as a hub id in the local Hugging Face cache "
        "(ignored, with a warning, for a local path, which has no revisions).",
    )
    trust_remote_code: bool = _honoured(
        False,
        "Let transformers run the model folder's own Python code to load its config and "
        "tokenizer (the weights always go into paged_llm's own model classes).",
        cli=_FLAG,
    )
    skip_tokenizer_init: bool = _honoured(
        False,
        "Load no tokenizer: prompts must be token ids, completions have empty text, and "
        "stop strings, bad_words and chat() are refused.",
    )
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = _honoured(
        None,
        "Changes to the model's Hugging Face config before the engine reads it: a dict of "
        "attributes to set, or a function that takes the config and returns the new one "
        "(defined at module level when data_parallel_size > 1: replicas get it pickled).",
    )
    chat_template: str | Path | None = _honoured(
        None,
        "The Jinja chat template chat() uses by default instead of the tokenizer's: the "
        "template text, or a path to a file holding it.",
        cli=_FLAG,
    )
    generation_config: str | Path = _honoured(
        "auto",
        '"auto": the model\'s generation_config.json gives the default SamplingParams of '
        'generate() and chat() without sampling_params; "vllm": vLLM\'s SamplingParams '
        "defaults instead; a folder: its generation_config.json. EOS tokens come from the "
        "file in every case.",
        cli=_FLAG,
    )
    override_generation_config: dict[str, Any] | None = _honoured(
        None,
        "Values that replace or extend those of generation_config.json (e.g. "
        '{"temperature": 0.5}), with generation_config "auto" or a folder.',
    )
    served_model_name: str | list[str] | None = _honoured(
        None,
        "The model's name in outputs that report one (llm_engine.model_config."
        "served_model_name); a list's first name is used. Defaults to the model argument.",
    )
    # ----- honoured: the engine -------------------------------------------------------------
    dtype: str | torch.dtype = _honoured(
        "auto",
        '"auto" (float32 on CPU, the checkpoint\'s dtype on GPU), "float32", "bfloat16" or '
        '"float16".',
        cli=_FLAG,
    )
    device: Any = _honoured(
        "auto", '"auto" (CUDA when available), "cpu", "cuda" or a Platform.', cli=_FLAG
    )
    seed: int | None = _honoured(
        0,
        "Seeds the draws of requests without a seed of their own; None draws a fresh seed at "
        "start-up, so those requests differ from run to run (as vLLM's seed=None).",
    )
    max_model_len: int | None = _honoured(
        None,
        "Longest sequence (prompt + output) the engine serves; defaults to the model's "
        "max_position_embeddings. Lower it to what you need: the KV cache is sized to hold "
        "at least one sequence this long.",
        cli=_FLAG,
    )
    max_num_seqs: int | None = _honoured(
        None, "Most sequences in one step (default 64 on CPU, 256 on GPU).", cli=_FLAG
    )
    max_num_batched_tokens: int | None = _honoured(
        None,
        "Most tokens in one step (default 2048 on CPU, 8192 on GPU; at least max_model_len "
        "when enable_chunked_prefill is False).",
        cli=_FLAG,
    )
    enable_chunked_prefill: bool | None = _honoured(
        None,
        "Prefill a prompt that does not fit in what is left of a step's token budget in "
        "chunks over several steps (None: True). False schedules every prompt whole, and "
        "then max_num_batched_tokens must be at least max_model_len.",
        cli=_FLAG,
    )
    block_size: int = _honoured(16, "Tokens per KV-cache block, a power of two.", cli=_FLAG)
    enable_prefix_caching: bool = _honoured(
        True,
        "Share the KV cache of identical prompt prefixes.",
        cli=CliFlag(names=("--prefix-caching",)),
    )
    kv_cache_memory_bytes: int | None = _honoured(
        None,
        "Size of the KV cache (on the CLI with units: 2GiB, 512M); by default a share of "
        "free memory.",
        cli=CliFlag(names=("--kv-cache-memory", "--kv-cache-memory-bytes"), parse=parse_bytes),
    )
    gpu_memory_utilization: float = _honoured(
        0.9, "On GPU, the share of device memory the engine may use.", cli=_FLAG
    )
    enforce_eager: bool = _honoured(False, "On GPU, never capture CUDA graphs.", cli=_FLAG)
    attention_backend: str = _honoured(
        "auto",
        '"auto" (the platform\'s), "cpu" (torch plus a C++ decode kernel built on first use; '
        'the CPU default), "torch" (torch operators only) or "triton" (the GPU default).',
        cli=_FLAG,
    )
    tensor_parallel_size: int = _honoured(
        1,
        "Split each layer's weights and KV heads over this many devices (worker processes "
        "on this machine; on CPU each rank is one process).",
        cli=_FLAG,
    )
    data_parallel_size: int = _honoured(
        1,
        "Run this many engine replicas in their own processes and spread the requests over "
        "them (each replica may be tensor parallel too). This process then tokenizes, "
        "validates and orders, and loads no weights. On CPU each replica takes its share of "
        "the cores; on CUDA replica r takes devices r * tensor_parallel_size onwards. "
        "Outputs are the same as with one replica, seeded or not. A replica that dies has "
        "its unfinished requests run again on the others. Replicas are spawned "
        'processes: a script needs the usual if __name__ == "__main__": guard.',
        cli=_FLAG,
    )
    distributed_executor_backend: str | None = _honoured(
        None,
        'None or "mp": tensor-parallel workers are processes on this machine; "uni": one '
        'process, as with tensor_parallel_size=1 (vLLM\'s name for it). "ray" is refused: '
        "for a Ray cluster use paged_llm.ray (Ray Data), one LLM per actor.",
        accepts=(None, "mp", "uni"),
    )
    max_logprobs: int = _honoured(
        20,
        "Most logprobs / prompt_logprobs a request may ask for (20, as vLLM); -1 allows up "
        "to the whole vocabulary. A request asking for more is refused with a ValueError.",
    )
    batch_invariant: bool = _honoured(
        False,
        "Compute every token's logits independently of the batch: of the other requests in "
        "a step, of how its prompt was chunked and of which prefix came from the prefix "
        "cache, so seeded and greedy outputs and their logprobs are bit-identical however "
        "they were run. Costs speed. CPU with the torch attention backend and "
        "tensor_parallel_size=1 (vLLM's VLLM_BATCH_INVARIANT=1).",
        cli=_FLAG,
    )
    disable_log_stats: bool = _honoured(
        False,
        "Do not log the one-line summary (requests, tokens/s, prefix-cache hit rate) after "
        "each generate() call. vLLM's LLM defaults to True; the summary is at INFO level, so "
        "it shows only where logging is configured to show it.",
    )
    load_format: str = _honoured(
        "auto",
        '"auto", "safetensors" or "gguf": paged_llm reads the format it finds. vLLM\'s other '
        'loaders ("pt", "dummy", "tensorizer", ...) are not available.',
        accepts=("auto", "safetensors", "gguf"),
    )
    config_format: str = _honoured(
        "auto", 'Hugging Face configs only: "auto" or "hf".', accepts=("auto", "hf")
    )
    task: str = _honoured(
        "auto", 'Text generation only: "auto" or "generate".', accepts=("auto", "generate")
    )
    runner: str = _honoured(
        "auto", 'Text generation only: "auto" or "generate".', accepts=("auto", "generate")
    )
    quantization: str | None = _honoured(
        None,
        "The format of the decoder layers' linear weights: None keeps the checkpoint's "
        "weights as stored (float; a .gguf file dequantized exactly to float; a pre-quantized "
        "checkpoint, whose config.json has a quantization_config, quantized); "
        '"compressed-tensors", "gptq" or "awq" names that pre-quantized format (any other '
        'value for such a checkpoint is refused); "int8" quantizes float weights at load '
        'time to int8 with one scale per output channel, "fp8" (CUDA only) to '
        'float8_e4m3fn with one scale per output channel; "gguf" keeps a .gguf file\'s '
        "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights quantized and dequantizes them in "
        "each matmul. Weight-only: activations stay in dtype. With int8, fp8 and gguf the "
        "embedding and LM head are quantized too unless quantize_embeddings=False. See "
        "docs/quantization.md.",
        cli=_FLAG,
        accepts=(None, *QUANTIZATION_METHODS),
    )
    quantize_embeddings: bool = _honoured(
        True,
        "With quantization set, also quantize the token embedding and the LM head (for "
        '"gguf": keep them as the file stores them, quantized or float). Not a vLLM argument: '
        "vLLM quantizes the LM head only when a checkpoint's config asks. False keeps both "
        "in dtype.",
        cli=_FLAG,
    )
    kv_cache_dtype: str = _honoured(
        "auto",
        'How the KV cache stores keys and values: "auto" in the model dtype; "fp8" (= '
        '"fp8_e4m3") or "fp8_e5m2" in one byte per element with a scale of 1.0, so the same '
        "memory holds 2x the tokens of a 16-bit cache and 4x those of a float32 one, at a "
        "small cost in quality (docs/quantization.md).",
        cli=_FLAG,
        accepts=tuple(KV_CACHE_DTYPES),
    )
    logprobs_mode: str = _honoured(
        "raw_logprobs",
        'Logprobs are those of the model\'s raw distribution: "raw_logprobs" only.',
        accepts=("raw_logprobs",),
    )
    scheduling_policy: str = _honoured(
        "fcfs",
        'Requests run first come, first served: "fcfs" only (so generate\'s priority must be 0).',
        accepts=("fcfs",),
    )
    # ----- no-ops ---------------------------------------------------------------------------
    download_dir: str | None = _no_op(
        None, "Nothing is downloaded: models come from local paths or the Hugging Face cache."
    )
    hf_token: bool | str | None = _no_op(None, "Nothing is downloaded, so no token is sent.")
    code_revision: str | None = _no_op(
        None, "Nothing is downloaded; trust_remote_code runs the local folder's code."
    )
    swap_space: float = _no_op(
        4, "Preempted sequences are recomputed, never swapped to CPU memory."
    )
    compilation_config: int | dict[str, Any] | None = _no_op(
        None, "paged_llm does not use torch.compile; enforce_eager controls CUDA graphs."
    )
    max_seq_len_to_capture: int = _no_op(
        8192, "CUDA graphs cover decode steps at every sequence length."
    )
    cuda_graph_sizes: list[int] | None = _no_op(
        None, "The captured decode batch sizes are chosen from max_num_seqs."
    )
    disable_custom_all_reduce: bool = _no_op(
        False, "Tensor parallelism uses torch.distributed's all-reduce only."
    )
    disable_async_output_proc: bool = _no_op(
        False, "Outputs are processed in the engine's step, never asynchronously."
    )
    async_scheduling: bool | None = _no_op(None, "Steps are scheduled one after the other.")
    profiler_config: Any = _no_op(
        None, "No built-in profiler hooks: profile generate() with torch.profiler or py-spy."
    )
    max_lora_rank: int = _no_op(16, "LoRA is not supported (see enable_lora).")
    max_loras: int = _no_op(1, "LoRA is not supported (see enable_lora).")
    max_cpu_loras: int | None = _no_op(None, "LoRA is not supported (see enable_lora).")
    enable_expert_parallel: bool = _no_op(
        False, "The supported architectures (Llama, Mistral, Qwen2, Qwen3) have no experts."
    )
    mm_processor_kwargs: dict[str, Any] | None = _no_op(None, "Text-only models.")
    limit_mm_per_prompt: dict[str, Any] | None = _no_op(None, "Text-only models.")
    allowed_local_media_path: str = _no_op("", "Text-only models.")
    use_tqdm_on_load: bool = _no_op(True, "Loading shows no progress bar.")
    # ----- refused unless neutral -----------------------------------------------------------
    enable_lora: bool = _refused_unless(
        (False,), "LoRA adapters are not supported; merge the adapter into the weights first."
    )
    cpu_offload_gb: float = _refused_unless(
        (0,),
        "Weights are never offloaded to CPU memory; lower max_model_len or use a GPU "
        "with more memory.",
    )
    pipeline_parallel_size: int = _refused_unless(
        (1,), "Pipeline parallelism is not supported; use tensor_parallel_size."
    )
    logits_processors: list[Any] | None = _refused_unless(
        (None, []),
        "Logits-processor callables are not supported; logit_bias, allowed_token_ids and "
        "bad_words in SamplingParams cover the common uses.",
    )
    speculative_config: dict[str, Any] | None = _refused_unless(
        (None,), "Speculative decoding is not supported."
    )
    enable_sleep_mode: bool = _refused_unless(
        (False,), "Sleep mode is not supported; shutdown() frees the weights and the cache."
    )
    enable_prompt_embeds: bool = _refused_unless(
        (False,), "Prompts are token ids or text; embeddings as input are not supported."
    )
    disable_sliding_window: bool = _refused_unless(
        (False,), "Sliding-window models always attend within their window."
    )

    def __post_init__(self) -> None:
        for setting in fields(self):
            accepts = setting.metadata.get(_ACCEPTS)
            value = getattr(self, setting.name)
            # NOTE: a bool matches only a bool: True == 1 would pass for a count.
            if accepts and not any(
                value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepts
            ):
                _refuse(setting, value)
        for name in ("trust_remote_code", "skip_tokenizer_init", "disable_log_stats"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _check(
            self.enable_chunked_prefill is None or isinstance(self.enable_chunked_prefill, bool),
            "enable_chunked_prefill",
            self.enable_chunked_prefill,
            "a bool or None",
        )
        _check(
            self.hf_overrides is None
            or isinstance(self.hf_overrides, dict)
            or callable(self.hf_overrides),
            "hf_overrides",
            self.hf_overrides,
            "a dict, a function of the config, or None",
        )
        _check(
            self.override_generation_config is None
            or isinstance(self.override_generation_config, dict),
            "override_generation_config",
            self.override_generation_config,
            "a dict or None",
        )
        names = self.served_model_name
        _check(
            names is None
            or isinstance(names, str)
            or (isinstance(names, list) and bool(names) and all(isinstance(n, str) for n in names)),
            "served_model_name",
            names,
            "a str, a non-empty list of str, or None",
        )

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        """The settings from `LLM`'s keyword arguments; an unknown name is a ValueError."""
        known = {setting.name for setting in fields(cls)}
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"LLM got unknown argument(s) {', '.join(hints)}. It takes vLLM's LLM arguments "
                "that apply offline; the list, with what each does here, is in docs/usage.md "
                '("Coming from vLLM").'
            )
        return cls(**kwargs)

    def to_kwargs(self) -> dict[str, Any]:
        """The settings as `LLM` keyword arguments (a shallow copy)."""
        return {setting.name: getattr(self, setting.name) for setting in fields(self)}


def add_cli_arguments(group: argparse._ArgumentGroup) -> None:
    """One flag per setting that has a `CliFlag`, its help the field's doc. Every flag
    defaults to None (unset), so `cli_settings` passes only what was given and `LLM` keeps
    its own defaults."""
    hints = typing.get_type_hints(EngineArgs)
    for setting in fields(EngineArgs):
        flag: CliFlag | None = setting.metadata.get(_CLI)
        if flag is None:
            continue
        names = flag.names or ("--" + setting.name.replace("_", "-"),)
        doc = setting.metadata[_DOC].replace("%", "%%")
        value_type = _cli_type(hints[setting.name])
        if value_type is bool:
            group.add_argument(
                *names, dest=setting.name, action=argparse.BooleanOptionalAction, help=doc
            )
        else:
            group.add_argument(*names, dest=setting.name, type=flag.parse or value_type, help=doc)


def cli_settings(namespace: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` keyword arguments of the flags given on the command line."""
    return {
        setting.name: value
        for setting in fields(EngineArgs)
        if setting.metadata.get(_CLI) is not None
        and (value := getattr(namespace, setting.name)) is not None
    }


def _cli_type(hint: Any) -> type:
    """The type a flag's text is parsed as: the first of bool, int, float in the field's
    type, else str (paths, names, "auto")."""
    members = typing.get_args(hint) or (hint,)
    return next((t for t in (bool, int, float) if t in members), str)


def settings_of_kind(kind: str) -> list[Field[Any]]:
    """The fields of `EngineArgs` of one kind: "honoured", "no-op" or "refused"."""
    return [setting for setting in fields(EngineArgs) if setting.metadata[_KIND] == kind]


def _refuse(setting: Field[Any], value: Any) -> None:
    accepts = setting.metadata[_ACCEPTS]
    allowed = " or ".join(repr(a) for a in accepts)
    raise ValueError(
        f"LLM argument {setting.name}={value!r} is not supported by paged_llm: "
        f"{setting.metadata[_DOC]} Leave it at {allowed}."
    )


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LLM argument {name} must be {allowed}, got {value!r}.")
