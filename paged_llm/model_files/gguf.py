"""Convert a llama.cpp GGUF file into a Hugging Face-format directory, once, into a cache.

The rest of paged_llm reads Hugging Face directories (config.json, *.safetensors, tokenizer
files), so a GGUF file is rewritten as one:

- weights: dequantized with `gguf.quants`, renamed from llama.cpp names to transformers names, with
  llama.cpp's rotary row permutation of q and k undone; quantized tensors are stored as float32
  (the only float type that holds every dequantized value exactly), F16/BF16/F32 tensors as is;
- config.json: transformers' GGUF config reader, plus `architectures`, `head_dim` and rope scaling;
- tokenizer files and chat template: transformers' GGUF tokenizer, saved with `save_pretrained`;
- generation_config.json: bos / eos / pad ids from the GGUF metadata.

A conversion may leave tensors out (``left_out``): those `quantization="gguf"` reads from
the .gguf file itself at every load, still quantized. Its cache entry is then another one,
and its marker file names them with their GGML types.

`cached_gguf_conversion` converts into a temporary directory next to the cache entry and renames
it into place, so an entry that exists is always complete.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from paged_llm.model_files.gguf_layout import GgufLayout, check_gguf_layout

logger = logging.getLogger(__name__)

# Part of every cache key: bump it when the converted layout or values change, so that entries
# written by an older converter are not reused. 2: config.json holds every field, not only
# those that differ from the config class's defaults (see `ResolvedModel.from_gguf`).
CONVERTER_VERSION = 2

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# llama.cpp's convert_hf_to_gguf.py permutes the q and k rows of these architectures only
# (LlamaModel.permute), because its rope kernel rotates adjacent pairs where transformers rotates
# the two halves of each head.
_ROPE_PERMUTED_ARCHITECTURES = frozenset({"llama"})

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

# How fast a conversion goes, for the estimate it logs first: SmolLM2's 98 MB Q4_1 file
# took 20-30 s on a 2-core machine, most of it dequantizing, which grows with the file.
_CONVERTED_BYTES_PER_SECOND = 4e6

# Written last into a finished conversion; its presence is what makes a cache entry valid.
MARKER_FILE = "paged_llm_gguf.json"

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3 rope scaling is stored as this per-frequency tensor instead of metadata.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"


def import_gguf() -> ModuleType:
    """Import the optional `gguf` package, with an install hint when it is missing."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError(
            "Reading .gguf files needs the optional `gguf` package: pip install gguf"
        ) from error
    return gguf


def gguf_layout(gguf_path: Path) -> GgufLayout:
    """The metadata and tensors of `gguf_path`, checked by `check_gguf_layout` (a
    ValueError naming the file and the field where a count or tensor lies outside it)."""
    return check_gguf_layout(import_gguf(), gguf_path)


def gguf_reader(gguf_path: Path) -> Any:
    """gguf-py's reader of `gguf_path`, once `check_gguf_layout` has found every count and
    tensor in the file inside it (a ValueError naming the file and the field otherwise)."""
    gguf = import_gguf()
    check_gguf_layout(gguf, gguf_path)
    return gguf.GGUFReader(gguf_path)


def gguf_cache_key(gguf_path: Path, left_out: frozenset[str] = frozenset()) -> str:
    """Name of the cache entry for `gguf_path` converted without the tensors ``left_out``
    (transformers names): it changes when the file is replaced or edited.

    Built from the resolved path, size and modification time (one `stat`, microseconds) rather
    than a content hash, which costs about 0.35 s per 100 MB and grows with the file.
    """
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    identity = f"{CONVERTER_VERSION}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    if left_out:
        identity += "\0" + "\0".join(sorted(left_out))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{resolved.stem}-{'quantized-' if left_out else ''}{digest}"


def cached_gguf_conversion(
    gguf_path: Path, cache_root: Path, left_out: frozenset[str] = frozenset()
) -> Path:
    """Return the Hugging Face directory converted from `gguf_path` without the tensors
    ``left_out`` (transformers names), converting it on first use.

    Entries live under `<cache_root>/gguf/<key>/` (see `gguf_cache_key`). A conversion is written
    into a temporary sibling directory and renamed into place only once complete, so a crash never
    leaves an entry that a later call would trust; temporary directories of dead processes are
    removed on the next conversion.
    """
    key = gguf_cache_key(gguf_path, left_out)
    entries = cache_root / "gguf"
    entry = entries / key
    if (entry / MARKER_FILE).is_file():
        return entry
    entries.mkdir(parents=True, exist_ok=True)
    # NOTE: only a rename creates `entry`, and the marker is written before it, so an entry without
    # marker was not made by this converter: replace it. (Re-checking the marker keeps an entry
    # that another process renamed into place since the check above.)
    if entry.exists() and not (entry / MARKER_FILE).is_file():
        logger.warning("Removing cache entry %s: it has no %s", entry, MARKER_FILE)
        shutil.rmtree(entry)
    if (entry / MARKER_FILE).is_file():
        return entry
    _remove_abandoned_temp_dirs(entries, key)

    temp_prefix = f".tmp-{key}-{socket.gethostname()}-{os.getpid()}-"
    temp_dir = Path(tempfile.mkdtemp(prefix=temp_prefix, dir=entries))
    if left_out:
        how = "the tensors kept quantized stay in the .gguf file"
    else:
        seconds = max(1, round(gguf_path.stat().st_size / _CONVERTED_BYTES_PER_SECOND))
        how = f"dequantizing its weights to float, ~{seconds} s"
    logger.info("Converting %s into %s (once; later loads reuse it): %s", gguf_path, entry, how)
    start = time.perf_counter()
    try:
        read_from_gguf = convert_gguf(gguf_path, temp_dir, left_out=left_out)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": str(gguf_path.resolve()),
            "source_size": gguf_path.stat().st_size,
            "source_mtime_ns": gguf_path.stat().st_mtime_ns,
            "seconds": round(time.perf_counter() - start, 3),
            "read_from_gguf": read_from_gguf,
        }
        (temp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp creates a private (0700) directory; a cache entry is as readable as a download.
        temp_dir.chmod(0o755)
        for written in temp_dir.iterdir():
            written.chmod(0o644)
        try:
            temp_dir.rename(entry)
        except OSError:
            # Another process finished the same conversion first; keep its entry.
            if not (entry / MARKER_FILE).is_file():
                raise
            shutil.rmtree(temp_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return entry


def _remove_abandoned_temp_dirs(entries: Path, key: str) -> None:
    """Delete temporary conversions of `key` whose process, on this host, no longer runs."""
    pattern = re.compile(rf"\.tmp-{re.escape(key)}-{re.escape(socket.gethostname())}-(\d+)-")
    for temp_dir in entries.glob(f".tmp-{key}-*"):
        match = pattern.match(temp_dir.name)
        if match is not None and not _process_is_alive(int(match.group(1))):
            logger.info("Removing %s, left by an interrupted conversion", temp_dir)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class _TensorPlan:
    """One output tensor: where it comes from and how it is transformed on the way."""

    hf_name: str
    source: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Heads to undo llama.cpp's rotary row permutation over; None for tensors it did not touch.
    rope_heads: int | None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    left_out: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Write a Hugging Face-format copy of a GGUF checkpoint into `out_dir`.

    Args:
        gguf_path: a single-file GGUF of one of `SUPPORTED_GGUF_ARCHITECTURES`.
        out_dir: created if missing; must be empty.
        max_shard_bytes: weights above this size are split into `model-0000N-of-0000M.safetensors`
            files plus `model.safetensors.index.json`, which also bounds the memory the
            conversion needs to about one shard.
        left_out: transformers names of tensors not to write (a load reads them from the
            file).

    Returns:
        The tensors left out, by their transformers names, with their GGML types.

    Raises:
        ValueError: the architecture, a tensor or the rope scaling is not supported.
        ImportError: the `gguf` package is not installed.
        OSError: not enough free disk space for the dequantized weights.
    """
    gguf = import_gguf()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise ValueError(f"out_dir {out_dir} must be empty")

    reader = gguf_reader(gguf_path)
    architecture = _metadata(reader, "general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {architecture!r} is not supported; supported "
            f"GGUF architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    config = _build_config(gguf_path, reader, architecture, tensors)
    plans = _plan_tensors(architecture, config, tensors)
    _check_against_model_class(gguf_path, config, plans)
    read_from_gguf = {
        plan.hf_name: plan.source.tensor_type.name for plan in plans if plan.hf_name in left_out
    }
    plans = [plan for plan in plans if plan.hf_name not in left_out]
    needed = sum(plan.nbytes for plan in plans)
    if (free := shutil.disk_usage(out_dir).free) < needed:
        raise OSError(
            f"converting {gguf_path.name} needs {needed / 1e9:.1f} GB of disk in {out_dir}, but "
            f"only {free / 1e9:.1f} GB are free (set PAGED_LLM_CACHE to another disk)"
        )
    _write_weights(gguf, plans, out_dir, max_shard_bytes)
    # Whole, not as a diff from the class's defaults: paged_llm reads it without the class.
    config.to_json_file(out_dir / "config.json", use_diff=False)
    _generation_config(reader).save_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    # The GGUF tokenizer has no length limit; the model's context length is the real one.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    return read_from_gguf


def _metadata(reader: Any, key: str) -> Any:
    """A scalar (number or string) metadata value of the GGUF file, or None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()


def _build_config(
    gguf_path: Path, reader: Any, architecture: str, tensors: dict[str, Any]
) -> transformers.PretrainedConfig:
    config: transformers.PretrainedConfig = transformers.AutoConfig.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.tie_word_embeddings = "output.weight" not in tensors
    # transformers maps only llama's rope.dimension_count to head_dim; Qwen3 heads are wider than
    # hidden_size / num_heads and their size is in attention.key_length.
    if (key_length := _metadata(reader, f"{architecture}.attention.key_length")) is not None:
        config.head_dim = key_length
    # GGUF stores eps as float32 (1e-5 becomes 9.99999975e-06); its shortest float32 repr is
    # the value of the original config.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    rope_scaling = _rope_scaling(reader, architecture, tensors, config)
    if rope_scaling is not None:
        if hasattr(config, "rope_parameters"):  # transformers >= 5 keeps theta and scaling together
            config.rope_parameters = {**config.rope_parameters, **rope_scaling}
        else:
            config.rope_scaling = rope_scaling
    weight_dtypes: Counter[torch.dtype] = Counter()
    for tensor in tensors.values():
        weight_dtypes[_output_dtype(tensor.tensor_type.name)] += int(tensor.n_elements)
    config.dtype = weight_dtypes.most_common(1)[0][0]
    return config


def _rope_scaling(
    reader: Any,
    architecture: str,
    tensors: dict[str, Any],
    config: transformers.PretrainedConfig,
) -> dict[str, Any] | None:
    """transformers' rope scaling parameters for the file, or None for plain rope."""
    scaling_type = _metadata(reader, f"{architecture}.rope.scaling.type") or "none"
    if _ROPE_FREQS_TENSOR in tensors:
        return _llama3_rope_scaling(tensors[_ROPE_FREQS_TENSOR], config)
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        factor = _metadata(reader, f"{architecture}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(
        f"rope scaling type {scaling_type!r} in GGUF metadata is not supported; supported: none, "
        "linear, and Llama 3 scaling stored as rope_freqs.weight"
    )


def _llama3_rope_scaling(rope_freqs: Any, config: transformers.PretrainedConfig) -> dict[str, Any]:
    """Recover Llama 3 rope scaling from the per-frequency factors llama.cpp stores.

    llama.cpp computes `rope_freqs` from `factor`, `low_freq_factor`, `high_freq_factor` and
    `original_max_position_embeddings`, and drops those. Every released Llama 3.1 / 3.2 / 3.3
    model uses 1, 4 and 8192 for the last three, so those are assumed, `factor` is the largest
    stored value, and the factors this gives are checked against the stored ones.
    """
    stored = np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope_theta = (
        config.rope_parameters["rope_theta"]
        if hasattr(config, "rope_parameters")
        else config.rope_theta
    )
    expected = _llama3_rope_factors(scaling, head_dim, rope_theta)
    if expected.shape != stored.shape or not np.allclose(expected, stored, rtol=1e-5):
        raise ValueError(
            f"{_ROPE_FREQS_TENSOR} does not match Llama 3 rope scaling with factor "
            f"{scaling['factor']}, low_freq_factor 1, high_freq_factor 4 and "
            "original_max_position_embeddings 8192; other rope_freqs are not supported"
        )
    return scaling


def _llama3_rope_factors(scaling: dict[str, Any], head_dim: int, rope_theta: float) -> np.ndarray:
    """The wavelength multipliers llama.cpp's convert_hf_to_gguf.py writes as rope_freqs."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old_context = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (old_context / wavelen - low) / (high - low)
    factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    factors = np.where(wavelen < old_context / high, 1.0, factors)
    return np.where(wavelen > old_context / low, factor, factors)


def _output_dtype(ggml_type: str) -> torch.dtype:
    """The smallest dtype that holds a tensor of this GGML type exactly."""
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(ggml_type, torch.float32)


def _plan_tensors(
    architecture: str,
    config: transformers.PretrainedConfig,
    tensors: dict[str, Any],
) -> list[_TensorPlan]:
    plans = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS_TENSOR:  # folded into config.json by _rope_scaling
            continue
        rope_heads = None
        if architecture in _ROPE_PERMUTED_ARCHITECTURES:
            if ".attn_q." in name:
                rope_heads = config.num_attention_heads
            elif ".attn_k." in name:
                rope_heads = config.num_key_value_heads
        plans.append(
            _TensorPlan(
                hf_name=_hf_tensor_name(name),
                source=tensor,
                # GGML lists dimensions fastest-varying first; torch lists them last.
                shape=tuple(int(dim) for dim in reversed(tensor.shape)),
                dtype=_output_dtype(tensor.tensor_type.name),
                rope_heads=rope_heads,
            )
        )
    return plans


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no transformers equivalent")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"


def _check_against_model_class(
    gguf_path: Path, config: transformers.PretrainedConfig, plans: list[_TensorPlan]
) -> None:
    """Fail now, not at load time, when the tensors do not fit the model class of the config."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    found = {plan.hf_name: plan.shape for plan in plans}
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong_shape = sorted(
        f"{name} {found[name]} (expected {expected[name]})"
        for name in expected.keys() & found.keys()
        if expected[name] != found[name]
    )
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"{gguf_path.name}: tensors do not match {type(model).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong_shape[:5]}"
        )


def _load_tensor(gguf: ModuleType, plan: _TensorPlan) -> torch.Tensor:
    qtype, data = plan.source.tensor_type, plan.source.data
    if qtype.name == "F16":
        tensor = torch.from_numpy(np.array(data.view(np.float16)))
    elif qtype.name == "BF16":
        tensor = torch.from_numpy(np.array(data.view(np.int16))).view(torch.bfloat16)
    else:
        try:
            values = gguf.quants.dequantize(data, qtype)
        except NotImplementedError as error:
            raise ValueError(
                f"GGUF tensor {plan.source.name} has GGML type {qtype.name}, which the installed "
                "gguf package cannot dequantize (try pip install -U gguf)"
            ) from error
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
    tensor = tensor.reshape(plan.shape)
    if plan.rope_heads is not None:
        tensor = _unpermute_rope_rows(tensor, plan.rope_heads)
    return tensor


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rows of a head: x0, x_{d/2}, x1, ... -> x0, x1, ...).

    The inverse of `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py, the same as
    transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape).contiguous()


def _write_weights(
    gguf: ModuleType, plans: list[_TensorPlan], out_dir: Path, max_shard_bytes: int
) -> None:
    shards: list[list[_TensorPlan]] = [[]]
    shard_bytes = 0
    for plan in plans:
        if shards[-1] and shard_bytes + plan.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(plan)
        shard_bytes += plan.nbytes
    if len(shards) == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]

    weight_map = {}
    for file_name, shard in zip(file_names, shards, strict=True):
        tensors = {plan.hf_name: _load_tensor(gguf, plan) for plan in shard}
        save_file(tensors, out_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(plan.nbytes for plan in plans)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _generation_config(reader: Any) -> transformers.GenerationConfig:
    """Special token ids from the GGUF metadata; GGUF files carry no sampling defaults."""
    # End of turn / end of message count as end of generation: chat models (Llama 3) emit them
    # instead of the plain eos token.
    eos_ids = [
        token_id
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (token_id := _metadata(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    return transformers.GenerationConfig(
        bos_token_id=_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        pad_token_id=_metadata(reader, "tokenizer.ggml.padding_token_id"),
    )
