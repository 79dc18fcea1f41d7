"""The engine's configuration, resolved and validated once when an `LLM` is built."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from paged_llm.distributed.model_splits import tensor_parallel_sizes
from paged_llm.engine_args import EngineArgs
from paged_llm.layers.attention import ATTENTION_BACKENDS, KV_CACHE_DTYPES
from paged_llm.layers.quantization.checkpoint_formats import resolve_quantization
from paged_llm.logits_processors import LogitsProcessor, load_logits_processors
from paged_llm.model_files.gguf_quantized import gguf_source
from paged_llm.model_files.resolve import check_config_fields
from paged_llm.platforms import Platform, get_platform
from paged_llm.pooling_params import PoolerConfig, convert_defaults
from paged_llm.settings import resolved_setting
from paged_llm.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "PoolerConfig", "PoolerSpec", "SchedulerConfig"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, platform: Platform) -> torch.dtype:
    """``"auto"``: float32 on CPU (its fast path), the checkpoint's dtype on GPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}.")
        return dtype
    if dtype == "auto":
        if not platform.auto_dtype_from_checkpoint:
            return torch.float32
        config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = _DTYPES.get(config_dtype)
        if isinstance(config_dtype, torch.dtype) and config_dtype in _DTYPES.values():
            return config_dtype
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """The model as ``llm.llm_engine.model_config`` reports it, with the field names of
    vLLM's ``ModelConfig`` that harnesses read (lm-eval reads ``max_model_len``)."""

    model: str
    tokenizer: str
    tokenizer_mode: str
    trust_remote_code: bool
    dtype: torch.dtype
    seed: int
    revision: str | None
    tokenizer_revision: str | None
    max_model_len: int
    max_logprobs: int
    hf_config: Any
    served_model_name: str
    generation_config: str
    skip_tokenizer_init: bool

    @property
    def hf_text_config(self) -> Any:
        """Text-only models: the config itself."""
        return self.hf_config

    def get_vocab_size(self) -> int:
        vocab_size: int = self.hf_config.vocab_size
        return vocab_size


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches (the `EngineArgs` of the same names, resolved)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # False: a prompt is admitted only when all of it fits in the step's budget.
    chunked_prefill: bool = True
    # Most distinct LoRA adapters among the running sequences; None: LoRA is off.
    max_loras: int | None = None


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache, by the names of vLLM's ``CacheConfig``."""

    block_size: int
    enable_prefix_caching: bool
    # The cache's element type, resolved (vLLM keeps the setting's name, "auto" or "fp8").
    cache_dtype: torch.dtype
    # Blocks of the allocated cache; None before the model runner has sized it.
    num_gpu_blocks: int | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """The LoRA settings (`EngineArgs` of the same names), resolved: LoRA is on."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclass(frozen=True)
class PoolerSpec:
    """A pooling model's pooler (``runner="pooling"``), resolved: its ``convert``, the
    `PoolerConfig` with that convert's defaults filled in, the classifier head it pools
    through (``num_labels`` outputs and their ``activation``: "softmax", "sigmoid" or
    "identity"; ``num_labels`` None: no head, the hidden states are the output), and the
    tasks it serves."""

    convert: str
    config: PoolerConfig
    num_labels: int | None
    activation: str
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    data_parallel_size: int


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device


@dataclass(frozen=True)
class VllmConfig:
    """The engine's settings in the sections of vLLM's ``VllmConfig``: what a custom
    `LogitsProcessor` is built with (`EngineConfig.vllm_config`)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig


@dataclass
class EngineConfig:
    """Everything the engine needs, with defaults resolved.

    Built by `EngineConfig.create` from `EngineArgs`; a field of the same name as a setting
    is that setting (see `EngineArgs` for its meaning), resolved against the model and the
    platform where its default depends on them.
    """

    model_dir: Path
    hf_config: Any
    dtype: torch.dtype
    # The KV cache's element type: ``dtype``, or an fp8 type.
    kv_cache_dtype: torch.dtype
    platform: Platform
    seed: int
    scheduler: SchedulerConfig
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    enforce_eager: bool
    attention_backend: str
    tensor_parallel_size: int
    data_parallel_size: int
    max_logprobs: int
    batch_invariant: bool
    quantization: str | None
    # Whether `quantization` covers the embedding and LM head too.
    quantize_embeddings: bool
    model_config: ModelConfig
    # The classes of the `logits_processors` setting, imported.
    logits_processors: tuple[type[LogitsProcessor], ...]
    # None: `enable_lora` is off.
    lora: LoRAConfig | None
    # "generate" or "pooling" (the `runner` setting resolved against the model).
    runner: str
    # The pooler of a pooling model; None under runner="generate".
    pooler: PoolerSpec | None
    # N-gram speculative decoding; None: off.
    speculative: SpeculativeConfig | None

    @property
    def device(self) -> torch.device:
        return self.platform.device

    def vllm_config(self, num_gpu_blocks: int | None = None) -> VllmConfig:
        """These settings as vLLM's ``VllmConfig``; ``num_gpu_blocks``: the KV cache's
        blocks, once allocated."""
        return VllmConfig(
            model_config=self.model_config,
            cache_config=CacheConfig(
                self.block_size, self.enable_prefix_caching, self.kv_cache_dtype, num_gpu_blocks
            ),
            scheduler_config=self.scheduler,
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.data_parallel_size),
            device_config=DeviceConfig(self.device),
        )

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @classmethod
    def create(cls, model_dir: Path, hf_config: Any, args: EngineArgs) -> EngineConfig:
        """Resolve the defaults of ``args`` against the model and the platform, and check
        what depends on them; a ValueError names the setting, its value and what is
        allowed (`EngineArgs` has checked each setting on its own)."""
        # Again after hf_overrides, which may have changed what config.json said.
        check_config_fields(hf_config, f"{model_dir / 'config.json'} with hf_overrides")
        platform = get_platform(args.device)
        scheduler = _scheduler_config(args, hf_config, platform)
        _check_parallel_sizes(
            hf_config, platform, args.tensor_parallel_size, args.data_parallel_size
        )
        if args.distributed_executor_backend == "uni" and args.tensor_parallel_size != 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs the model in one process, and "
                f"tensor_parallel_size={args.tensor_parallel_size} needs one per rank; use "
                "distributed_executor_backend='mp' (or None)."
            )
        attention_backend = args.attention_backend
        if attention_backend == "auto":
            attention_backend = platform.default_attention_backend
        if attention_backend == "triton" and not platform.runs_triton():
            raise ValueError(
                "attention_backend='triton' on CPU runs only under the Triton interpreter: set "
                "TRITON_INTERPRET=1 before importing paged_llm (slow; meant for tests), or use "
                "attention_backend='cpu' (the CPU default)."
            )
        if args.batch_invariant:
            _check_batch_invariance(attention_backend, args.tensor_parallel_size)
            if args.enable_lora:
                raise ValueError(
                    "batch_invariant=True and enable_lora=True: adapters are computed per "
                    "group of tokens, so a token's result depends on its batch; turn one off."
                )
        dtype = resolve_dtype(args.dtype, hf_config, platform)
        kv_cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or dtype
        platform.check_kv_cache_dtype(kv_cache_dtype, attention_backend)
        platform.check_quantization(args.quantization)
        seed = secrets.randbits(63) if args.seed is None else args.seed
        runner = _runner(args, hf_config)
        resolved = {
            "model_dir": model_dir,
            "hf_config": hf_config,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "platform": platform,
            "scheduler": scheduler,
            "enable_prefix_caching": bool(args.enable_prefix_caching),
            "enforce_eager": bool(args.enforce_eager),
            "attention_backend": attention_backend,
            "seed": seed,
            "quantization": _weight_format(args.quantization, model_dir, hf_config),
            "model_config": _model_config(args, model_dir, hf_config, dtype, seed, scheduler),
            "logits_processors": load_logits_processors(args.logits_processors),
            "lora": _lora_config(args),
            "runner": runner,
            "pooler": None if runner == "generate" else _pooler_spec(args, hf_config),
            "speculative": _speculative_config(args, runner),
        }
        # The other fields are settings taken as given, under the same names.
        return cls(
            **resolved,
            **{
                setting.name: getattr(args, setting.name)
                for setting in fields(cls)
                if setting.name not in resolved
            },
        )


def _model_config(
    args: EngineArgs,
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    seed: int,
    scheduler: SchedulerConfig,
) -> ModelConfig:
    names = args.served_model_name
    served = names[0] if isinstance(names, list) else names
    return ModelConfig(
        model=str(args.model),
        tokenizer=str(args.tokenizer or model_dir),
        tokenizer_mode=args.tokenizer_mode,
        trust_remote_code=args.trust_remote_code,
        dtype=dtype,
        seed=seed,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        max_model_len=scheduler.max_model_len,
        max_logprobs=args.max_logprobs,
        hf_config=hf_config,
        served_model_name=served if served is not None else str(args.model),
        generation_config=str(args.generation_config),
        skip_tokenizer_init=args.skip_tokenizer_init,
    )


def is_sequence_classifier(hf_config: Any) -> bool:
    """The checkpoint is a ``*ForSequenceClassification``: a decoder with a classifier head
    and no LM head."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def _weight_format(requested: str | None, model_dir: Path, hf_config: Any) -> str | None:
    """The quantization the weights load with: "gguf" for a .gguf file whose directory left
    its quantized tensors in the file (what `resolve_model` does for None and "gguf"), else
    what ``requested`` and the checkpoint say (`resolve_quantization`); "gguf" needs a
    directory converted from a .gguf file."""
    source = gguf_source(model_dir)
    if source is not None and source.read_from_gguf:
        if requested not in (None, "gguf"):
            raise ValueError(
                f"{model_dir} holds a .gguf file's float tensors only, and "
                f"quantization={requested!r} needs all of them as float: resolve the model "
                "with the same quantization argument."
            )
        return "gguf"
    if requested == "gguf" and source is None:
        raise ValueError(
            f"LLM argument quantization='gguf' keeps a .gguf file's weights quantized; "
            f"{model_dir} was not made from one. Pass the .gguf file as the model."
        )
    return resolve_quantization(requested, hf_config)


def _runner(args: EngineArgs, hf_config: Any) -> str:
    """``runner`` resolved: "auto" is pooling for a classifier, generate otherwise."""
    classifier = is_sequence_classifier(hf_config)
    runner = args.runner
    if runner == "auto":
        runner = "pooling" if classifier else "generate"
    if runner == "generate":
        if classifier:
            raise ValueError(
                f"LLM argument runner='generate', but {hf_config.architectures[0]} is a "
                "classifier: it has no LM head to generate with. Use runner='pooling' (or "
                "'auto') and llm.classify / llm.score."
            )
        for name in ("convert", "pooler_config"):
            if getattr(args, name) not in ("auto", None):
                raise ValueError(
                    f"LLM argument {name}={getattr(args, name)!r} configures a pooling model, "
                    "and this LLM generates; pass runner='pooling' too."
                )
    return runner


def _pooler_spec(args: EngineArgs, hf_config: Any) -> PoolerSpec:
    """The pooler of a pooling model: ``convert`` resolved and checked against the
    checkpoint, the pooler config's defaults filled in, the tasks it serves."""
    classifier = is_sequence_classifier(hf_config)
    convert = args.convert
    if convert == "auto":
        convert = "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise ValueError(
            f"LLM argument convert='classify' needs a classifier head, and "
            f"{(getattr(hf_config, 'architectures', None) or ['this model'])[0]} has none; "
            "load a *ForSequenceClassification checkpoint, or use convert='embed'."
        )
    config = convert_defaults(PoolerConfig.of(args.pooler_config), convert)
    num_labels = (
        getattr(hf_config, "num_labels", None) if classifier and convert != "embed" else None
    )
    problem_type = getattr(hf_config, "problem_type", None)
    activation = (
        "identity"
        if problem_type == "regression"
        else "sigmoid"
        if num_labels == 1 or problem_type == "multi_label_classification"
        else "softmax"
    )
    tasks = {
        "embed": ("embed", "token_embed"),
        "classify": ("classify", "score", "token_classify"),
        "reward": ("token_classify",) if num_labels is not None else ("token_embed",),
    }[convert] + ("encode", "reward")
    if config.pooling_type == "ALL":
        tasks = tuple(
            task for task in tasks if task.startswith("token_") or task in ("encode", "reward")
        )
    return PoolerSpec(convert, config, num_labels, activation, tasks)


def _speculative_config(args: EngineArgs, runner: str) -> SpeculativeConfig | None:
    speculative = SpeculativeConfig.of(args.speculative_config)
    if speculative is None:
        return None
    if runner == "pooling":
        raise ValueError(
            "speculative_config speeds up generation, and runner='pooling' generates nothing; "
            "leave speculative_config unset."
        )
    if args.logits_processors:
        raise ValueError(
            "speculative_config with logits_processors: a custom processor keeps state for one "
            "token per request and step, and a speculative step scores several; use one of them "
            "(SamplingParams.logits_processors, per request, work with speculation)."
        )
    return speculative


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    max_cpu_loras = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if max_cpu_loras < args.max_loras:
        raise ValueError(
            f"LLM argument max_cpu_loras={max_cpu_loras} is smaller than "
            f"max_loras={args.max_loras}: every adapter of a step is kept in host memory; "
            f"use max_cpu_loras >= {args.max_loras} (or None)."
        )
    return LoRAConfig(args.max_loras, args.max_lora_rank, max_cpu_loras)


def _scheduler_config(args: EngineArgs, hf_config: Any, platform: Platform) -> SchedulerConfig:
    """The scheduler's settings: platform defaults filled in, max_model_len from the model."""
    model_max_len = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = args.max_model_len
    if max_model_len is None:
        if model_max_len is None:
            raise ValueError("The model config has no max_position_embeddings; pass max_model_len.")
        max_model_len = model_max_len
    if model_max_len is not None and max_model_len > model_max_len:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's maximum context length "
            f"(max_position_embeddings={model_max_len}); use max_model_len <= {model_max_len}."
        )
    chunked_prefill = args.enable_chunked_prefill is not False
    settings = {
        setting.name: resolved_setting(args, setting.name, platform.name)
        for setting in fields(SchedulerConfig)
        if setting.name not in ("max_model_len", "chunked_prefill", "max_loras")
    }
    if not chunked_prefill:
        if args.max_num_batched_tokens is None:
            settings["max_num_batched_tokens"] = max(
                settings["max_num_batched_tokens"], max_model_len
            )
        elif args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"LLM argument max_num_batched_tokens={args.max_num_batched_tokens} is smaller "
                f"than max_model_len={max_model_len}, and enable_chunked_prefill=False "
                "schedules each prompt whole, so longer prompts could never run. Raise "
                "max_num_batched_tokens, lower max_model_len, or enable chunked prefill."
            )
    return SchedulerConfig(
        **settings,
        max_model_len=max_model_len,
        chunked_prefill=chunked_prefill,
        max_loras=args.max_loras if args.enable_lora else None,
    )


def _check_batch_invariance(attention_backend: str, tensor_parallel_size: int) -> None:
    if not ATTENTION_BACKENDS[attention_backend].supports_batch_invariance:
        raise ValueError(
            f"batch_invariant=True: the {attention_backend!r} attention backend cannot compute "
            "a token's attention independently of the rest of the batch; use "
            "attention_backend='cpu' or 'torch'."
        )
    if tensor_parallel_size != 1:
        # NOTE: a collective's summation order over more than two ranks can change with the
        # message size, that is with the batch.
        raise ValueError(
            f"batch_invariant=True is implemented for tensor_parallel_size=1, got "
            f"{tensor_parallel_size}; use data_parallel_size for more processes."
        )


def _check_parallel_sizes(
    hf_config: Any, platform: Platform, tensor_parallel_size: int, data_parallel_size: int
) -> None:
    """Whether the model splits into ``tensor_parallel_size`` shards, and the devices suffice."""
    tp = tensor_parallel_size
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    intermediate = hf_config.intermediate_size
    working = tensor_parallel_sizes(hf_config)
    if tp not in working:
        raise ValueError(
            f"LLM argument tensor_parallel_size={tp} does not split this model: it needs to "
            f"divide num_attention_heads={num_heads} and intermediate_size={intermediate}, and "
            f"either divide num_key_value_heads={num_kv_heads} or be a multiple of it (KV "
            f"heads are then replicated). Sizes that work: {working}."
        )
    available = platform.device_count()
    needed = tp * data_parallel_size
    if available is not None and needed > available:
        raise ValueError(
            f"tensor_parallel_size={tp} x data_parallel_size={data_parallel_size} needs "
            f"{needed} {platform.name} devices, and {available} are visible."
        )
