"""Read and validate a LoRA adapter saved by PEFT (`PeftModel.save_pretrained`).

An adapter directory holds `adapter_config.json` and its weights, `adapter_model.safetensors`
(or the older pickled `adapter_model.bin`), with one pair of tensors per adapted linear layer:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out_features, r]

and the layer computes `base(x) + scaling * x @ A.T @ B.T`, with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` under `use_rslora`), r and lora_alpha per module where
`rank_pattern` / `alpha_pattern` name it. Only this plain form on the attention and MLP
projections is served; everything else (DoRA, biases, saved modules, embedding adapters, other
PEFT variants) is refused with a `LoRAAdapterError` that says what and why.

The modules an adapter targets are read from its tensor names, never from the config's
`target_modules` (a list, a regex or "all-linear", resolved by PEFT against the model).
"""

import json
import math
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

_CONFIG_FILE = "adapter_config.json"
# In PEFT's order of preference: it reads the safetensors file when both are there.
_WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT prefixes every tensor with the wrapper's path to the transformers model.
_KEY_RE = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<side>[AB])\.weight")
_MODULE_RE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<target>\w+)")
_ATTENTION_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")

# adapter_config.json fields that, when set (truthy), make the adapter compute something
# other than `scaling * x @ A.T @ B.T` on the base model as it is, and what each one is.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "whole modules trained and saved beside the LoRA weights",
    "fan_in_fan_out": "transposed (Conv1D-style) base weights",
    "lora_bias": "a trained bias on lora_B",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated base-model layers",
    "target_parameters": "LoRA on raw parameters (such as MoE experts)",
    "use_qalora": "QALoRA (pooled inputs to lora_A)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "monteclora_config": "the MonteCLoRA variant",
    "use_bdlora": "the block-diagonal BD-LoRA variant",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "the KaSA variant",
}

# init_lora_weights values under which PEFT rewrote the base weights when it created the
# adapter, so the saved weights only fit that rewritten base model (PiSSA, CorDA, OLoRA and
# LoRA-GA subtract their initial A/B from it; LoftQ quantizes it).
_BASE_MODIFYING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: ``path`` is the adapter directory and ``reason``
    says which field or tensor is at fault, its value, and what is supported or the fix.
    ``str()`` is ``"LoRA adapter {path}: {reason}"``."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"LoRA adapter {path}: {reason}")
        self.path = str(path)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LoRAModuleWeights:
    """One adapted linear layer: its output gains ``x @ lora_a.T @ lora_b.T``.

    Attributes:
        lora_a: [rank, in_features], float32.
        lora_b: [out_features, rank], float32, already multiplied by the module's scaling.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A validated adapter, its weights in host memory.

    Attributes:
        path: the adapter directory, as given.
        rank: the largest rank of any of its modules.
        modules: keyed by the module's name in the transformers model
            ("model.layers.0.self_attn.q_proj"); only the modules the adapter targets.
    """

    path: str
    rank: int
    modules: dict[str, LoRAModuleWeights]

    @property
    def num_bytes(self) -> int:
        """Host memory its tensors take."""
        return sum(
            tensor.numel() * tensor.element_size()
            for weights in self.modules.values()
            for tensor in (weights.lora_a, weights.lora_b)
        )


@dataclass(frozen=True, slots=True)
class _ModulePlan:
    """One module's tensors, once the names and shapes are checked."""

    a_key: str
    b_key: str
    rank: int
    scaling: float


def check_lora_adapter(path: str | os.PathLike[str], max_lora_rank: int, hf_config: Any) -> int:
    """Validate the adapter at ``path`` for the model of ``hf_config`` without reading its
    weights' data, and return its largest rank.

    Reads adapter_config.json and the tensors' names and shapes from the safetensors header,
    so it is cheap enough for request intake; an ``adapter_model.bin`` has no header to read
    apart, so it is loaded (weights-only) to see its shapes.

    Raises:
        LoRAAdapterError: the adapter is missing, of an unsupported kind, does not fit the
            model, or has a rank above ``max_lora_rank``.
    """
    directory, weights_file = _adapter_files(path)
    config = _read_config(path, directory)
    if weights_file.suffix == ".safetensors":
        shapes = _safetensors_shapes(path, weights_file)
    else:
        shapes = {key: tuple(tensor.shape) for key, tensor in _load_bin(path, weights_file).items()}
    plans = _plan_modules(path, config, shapes, hf_config)
    return _checked_rank(path, plans, max_lora_rank)


def load_lora_adapter(
    path: str | os.PathLike[str], max_lora_rank: int, hf_config: Any
) -> LoRAAdapter:
    """Read and validate the adapter at ``path`` for the model of ``hf_config``: the checks
    of `check_lora_adapter`, then its weights, as float32 with the scaling folded into B.

    Raises:
        LoRAAdapterError: as `check_lora_adapter`.
    """
    directory, weights_file = _adapter_files(path)
    config = _read_config(path, directory)
    if weights_file.suffix == ".safetensors":
        tensors = _load_safetensors(path, weights_file)
    else:
        tensors = _load_bin(path, weights_file)
    shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    plans = _plan_modules(path, config, shapes, hf_config)
    rank = _checked_rank(path, plans, max_lora_rank)
    modules = {
        name: LoRAModuleWeights(
            lora_a=tensors[plan.a_key].to(torch.float32).contiguous(),
            # NOTE: scaled in float32, after the upcast, so a bf16 adapter loses nothing more.
            lora_b=(tensors[plan.b_key].to(torch.float32) * plan.scaling).contiguous(),
        )
        for name, plan in plans.items()
    }
    return LoRAAdapter(path=str(path), rank=rank, modules=modules)


def _adapter_files(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The adapter directory and its weights file, or why they are not there."""
    directory = Path(path)
    expected = f"a directory with {_CONFIG_FILE} and {' or '.join(_WEIGHTS_FILES)}"
    if not directory.exists():
        raise LoRAAdapterError(path, f"no such file or directory; expected {expected}.")
    if not directory.is_dir():
        raise LoRAAdapterError(path, f"is not a directory; expected {expected}.")
    if not (directory / _CONFIG_FILE).is_file():
        raise LoRAAdapterError(path, f"has no {_CONFIG_FILE}; expected {expected}.")
    for name in _WEIGHTS_FILES:
        if (directory / name).is_file():
            return directory, directory / name
    raise LoRAAdapterError(path, f"has no weights file; expected {expected}.")


def _read_config(path: str | os.PathLike[str], directory: Path) -> dict[str, Any]:
    """adapter_config.json, checked for the fields that make an adapter unservable."""
    try:
        config = json.loads((directory / _CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(path, f"cannot read {_CONFIG_FILE}: {error}.") from error
    if not isinstance(config, dict):
        raise LoRAAdapterError(
            path, f"{_CONFIG_FILE} holds a {type(config).__name__}, not a JSON object."
        )
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(
            path, f"{_CONFIG_FILE} has peft_type={peft_type!r}; only 'LORA' adapters are supported."
        )
    supported = (
        f"supported: plain LoRA (bias='none', no variants) on {', '.join(LORA_TARGET_MODULES)}"
    )
    for field, what in _REFUSED_FIELDS.items():
        if config.get(field):
            raise LoRAAdapterError(
                path,
                f"{_CONFIG_FILE} has {field}={config[field]!r}: {what} is not supported "
                f"({supported}); train or export the adapter without {field}.",
            )
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(
            path,
            f"{_CONFIG_FILE} has bias={bias!r}: trained biases are not supported ({supported}); "
            "train the adapter with bias='none'.",
        )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise LoRAAdapterError(
            path,
            f"{_CONFIG_FILE} has init_lora_weights={init!r}: PEFT rewrote the base model's "
            "weights when it created this adapter, so it does not apply to the original model; "
            "convert it to a plain LoRA (save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)) or merge it into the model.",
        )
    targets = config.get("target_modules")
    embedding = [name for name in _EMBEDDING_MODULES if _targets_module(targets, name)]
    if embedding:
        raise LoRAAdapterError(
            path,
            f"{_CONFIG_FILE} has target_modules={targets!r}, which adapts {', '.join(embedding)}: "
            f"embedding and LM-head adapters are not supported ({supported}).",
        )
    return config


def _targets_module(target_modules: Any, module: str) -> bool:
    """Whether PEFT's `target_modules` (a list of name suffixes, or one regex that must match
    the whole module name) selects ``module``."""
    if isinstance(target_modules, str):
        try:
            return re.fullmatch(target_modules, module) is not None
        except re.error:
            # An invalid regex selects nothing here; the tensor names decide what is adapted.
            return False
    if isinstance(target_modules, list):
        return any(
            isinstance(target, str) and (module == target or module.endswith(f".{target}"))
            for target in target_modules
        )
    return False


def _safetensors_shapes(
    path: str | os.PathLike[str], weights_file: Path
) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the file's header only."""
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            names: list[str] = handle.keys()
            return {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    except (OSError, SafetensorError) as error:
        raise LoRAAdapterError(path, f"cannot read {weights_file.name}: {error}.") from error


def _load_safetensors(path: str | os.PathLike[str], weights_file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(weights_file), device="cpu")
    except (OSError, SafetensorError) as error:
        raise LoRAAdapterError(path, f"cannot read {weights_file.name}: {error}.") from error


def _load_bin(path: str | os.PathLike[str], weights_file: Path) -> dict[str, torch.Tensor]:
    # NOTE: weights_only=True: a full unpickle of an untrusted file could run any code.
    try:
        state = torch.load(weights_file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise LoRAAdapterError(
            path,
            f"cannot read {weights_file.name} as a weights-only torch file ({error}); "
            "save the adapter as adapter_model.safetensors instead.",
        ) from error
    if not isinstance(state, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items()
    ):
        raise LoRAAdapterError(
            path, f"{weights_file.name} is not a dict of tensors by name, as PEFT saves it."
        )
    return state


def _plan_modules(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    hf_config: Any,
) -> dict[str, _ModulePlan]:
    """Check every tensor's name and shape against the model, and pair each module's A and B
    with its rank and scaling."""
    embedding = next((key for key in sorted(shapes) if ".lora_embedding_" in key), None)
    if embedding is not None:
        raise LoRAAdapterError(
            path,
            f"tensor {embedding} adapts an embedding: embedding and LM-head adapters are not "
            f"supported (supported targets: {', '.join(LORA_TARGET_MODULES)}).",
        )
    if not shapes:
        raise LoRAAdapterError(path, "its weights file holds no tensors.")
    features = _module_features(hf_config)
    num_layers = int(hf_config.num_hidden_layers)
    pairs: dict[str, dict[str, str]] = {}
    for key in sorted(shapes):
        match = _KEY_RE.fullmatch(key)
        if match is None:
            raise LoRAAdapterError(
                path,
                f"unexpected tensor {key}: only 'base_model.model.<module>.lora_A.weight' and "
                "'...lora_B.weight' are supported (no DoRA magnitudes, LoRA biases, saved "
                "modules or other PEFT variants).",
            )
        module = match["module"]
        target = module.rsplit(".", 1)[-1]
        if target not in LORA_TARGET_MODULES:
            raise LoRAAdapterError(
                path,
                f"tensor {key} adapts module {module!r}, which is not supported (embedding and "
                f"LM-head adapters neither); supported targets: {', '.join(LORA_TARGET_MODULES)}.",
            )
        name = _MODULE_RE.fullmatch(module)
        block = "self_attn" if target in _ATTENTION_TARGETS else "mlp"
        if name is None or name["block"] != block:
            raise LoRAAdapterError(
                path,
                f"tensor {key} names module {module!r}; expected transformers' name for a "
                f"decoder layer's projection, 'model.layers.<index>.{block}.{target}' (was the "
                "adapter trained on a different model class?).",
            )
        if int(name["layer"]) >= num_layers:
            raise LoRAAdapterError(
                path,
                f"tensor {key} adapts layer {name['layer']}, but the model has "
                f"num_hidden_layers={num_layers} (layers 0 to {num_layers - 1}); the adapter "
                "was trained for a different base model.",
            )
        pairs.setdefault(module, {})[match["side"]] = key
    return {
        module: _plan_module(path, config, module, keys, shapes, features)
        for module, keys in pairs.items()
    }


def _plan_module(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    module: str,
    keys: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    features: dict[str, tuple[int, int]],
) -> _ModulePlan:
    """One module's rank and scaling, after checking its A and B shapes."""
    for side, other in (("A", "B"), ("B", "A")):
        if side not in keys:
            raise LoRAAdapterError(
                path,
                f"tensor {keys[other]} has no partner base_model.model.{module}.lora_{side}.weight; "
                "every adapted module needs both lora_A and lora_B.",
            )
    a_key, b_key = keys["A"], keys["B"]
    r = _pattern_value(path, config, "rank_pattern", module, config.get("r", 8))
    alpha = _pattern_value(path, config, "alpha_pattern", module, config.get("lora_alpha", 8))
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoRAAdapterError(
            path, f"the rank {r!r} that {_CONFIG_FILE} gives {module} is not a positive integer."
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAAdapterError(
            path, f"the lora_alpha {alpha!r} that {_CONFIG_FILE} gives {module} is not a number."
        )
    in_features, out_features = features[module.rsplit(".", 1)[-1]]
    for key, expected in ((a_key, (r, in_features)), (b_key, (out_features, r))):
        if shapes[key] != expected:
            raise LoRAAdapterError(
                path,
                f"tensor {key} has shape {list(shapes[key])}; expected {list(expected)} "
                f"([r, in_features] for lora_A, [out_features, r] for lora_B, with r={r} from "
                f"{_CONFIG_FILE}'s r / rank_pattern and the features of this model); the adapter "
                "was trained for a different base model, or its config does not match its weights.",
            )
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRAAdapterError(
            path, f"{_CONFIG_FILE} has use_rslora={use_rslora!r}; expected true or false."
        )
    # Rank-stabilized LoRA (rsLoRA) scales by 1/sqrt(r) so the update keeps its size as r grows.
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    return _ModulePlan(a_key=a_key, b_key=b_key, rank=r, scaling=scaling)


def _pattern_value(
    path: str | os.PathLike[str], config: dict[str, Any], field: str, module: str, default: Any
) -> Any:
    """The value `rank_pattern` or `alpha_pattern` gives ``module``, else ``default``.

    As PEFT's `get_pattern_key`: the first key, a regex, that matches the end of the module
    name on a dot boundary ("q_proj", "layers.1.mlp.down_proj", "layers\\.[01]\\..*")."""
    pattern = config.get(field) or {}
    if not isinstance(pattern, dict):
        raise LoRAAdapterError(
            path, f"{_CONFIG_FILE} has {field}={pattern!r}; expected an object of name: value."
        )
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as error:
            raise LoRAAdapterError(
                path, f"{_CONFIG_FILE} has {field} key {key!r}, not a valid regex ({error})."
            ) from error
    return default


def _module_features(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Each target's (in_features, out_features) in the model of ``hf_config``."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    # NOTE: as paged_llm.models.llama: an explicit head_dim (Qwen3, some Mistrals) need not be
    # hidden_size // num_attention_heads.
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    intermediate = int(hf_config.intermediate_size)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def _checked_rank(
    path: str | os.PathLike[str], plans: dict[str, _ModulePlan], max_lora_rank: int
) -> int:
    """The adapter's largest rank, refused above ``max_lora_rank``."""
    module, plan = max(plans.items(), key=lambda item: item[1].rank)
    if plan.rank > max_lora_rank:
        raise LoRAAdapterError(
            path,
            f"rank {plan.rank} (of {module}, its largest) is above max_lora_rank="
            f"{max_lora_rank}; raise max_lora_rank to at least {plan.rank}.",
        )
    return plan.rank
