"""Pooling parameters and the pooler configuration, with vLLM's names, defaults and meaning.

A pooling request runs its prompt through the model and returns what the pooler makes of
the hidden states after the final norm, instead of generating: an embedding (``embed``), a
classifier's probabilities (``classify``, ``score``), or one vector per token
(``token_embed``, ``token_classify``; vLLM's older ``encode`` and ``reward`` are the same
per-token outputs with no normalization and no activation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_llm.exceptions import VLLMValidationError

# How a sequence's hidden states become one output: the last token's, the mean over the
# prompt, the first token's; or every token's (the per-token tasks).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# The tasks a pooling request can ask for (`LLM.encode`'s ``pooling_task``).
SEQUENCE_TASKS = ("embed", "classify", "score")
TOKEN_TASKS = ("token_embed", "token_classify", "encode", "reward")
POOLING_TASKS = SEQUENCE_TASKS + TOKEN_TASKS
# The per-token tasks that return the model's raw output: no normalization, no activation.
RAW_TASKS = ("encode", "reward")
# What `LLM(convert=...)` turns a model into.
CONVERTS = ("embed", "classify", "reward")


def _check_bool(owner: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise VLLMValidationError(
            f"{owner}.{name} must be True, False or None, got {value!r}.",
            parameter=name,
            value=value,
        )


def _use_activation(owner: str, values: dict[str, bool | None]) -> bool | None:
    """``use_activation`` from it and its older names ``softmax`` and ``activation``: they
    must agree where more than one is given."""
    given = {name: value for name, value in values.items() if value is not None}
    for name, value in given.items():
        _check_bool(owner, name, value)
    if len(set(given.values())) > 1:
        raise VLLMValidationError(
            f"{owner} got {', '.join(f'{n}={v}' for n, v in given.items())}: softmax and "
            "activation are older names of use_activation; give one of them.",
            parameter="use_activation",
            value=given,
        )
    return next(iter(given.values()), None)


def _check_dimensions(owner: str, dimensions: object) -> None:
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise VLLMValidationError(
            f"{owner}.dimensions must be an int >= 1 or None, got {dimensions!r}.",
            parameter="dimensions",
            value=dimensions,
        )


@dataclass
class PoolerConfig:
    """How a pooling model pools (vLLM's ``PoolerConfig``, `LLM(pooler_config=...)`); a
    field left None takes the default of the model's ``convert`` (docs/usage.md, "Pooling").

    ``pooling_type`` applies to the sequence tasks (embed, classify, score): ``"LAST"``,
    ``"MEAN"``, ``"CLS"``, or ``"ALL"`` (every token's output for them too).
    ``normalize``: L2-normalize embeddings. ``use_activation`` (older names ``softmax``,
    ``activation``): apply the classifier's activation (softmax, or sigmoid for one label).
    ``dimensions``: keep the first this many dimensions of an embedding (Matryoshka).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise VLLMValidationError(
                f"PoolerConfig.pooling_type must be one of {', '.join(POOLING_TYPES)} or None, "
                f"got {self.pooling_type!r}.",
                parameter="pooling_type",
                value=self.pooling_type,
            )
        _check_bool("PoolerConfig", "normalize", self.normalize)
        _check_dimensions("PoolerConfig", self.dimensions)
        self.use_activation = _use_activation(
            "PoolerConfig",
            {
                "use_activation": self.use_activation,
                "softmax": self.softmax,
                "activation": self.activation,
            },
        )
        self.softmax = self.activation = None

    @classmethod
    def of(cls, value: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        """The setting as a `PoolerConfig`: itself, a dict of its fields (as the command
        line's JSON gives it), or None (every field None)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        unknown = sorted(set(value) - {name for name in cls.__dataclass_fields__})
        if unknown:
            raise VLLMValidationError(
                f"pooler_config has unknown field(s) {unknown}; it takes "
                f"{', '.join(cls.__dataclass_fields__)}.",
                parameter="pooler_config",
                value=value,
            )
        return cls(**value)


@dataclass
class PoolingParams:
    """What a pooling request asks of the pooler (vLLM's ``PoolingParams``); a field left
    None takes the model's `PoolerConfig` value, then the task's default.

    ``dimensions``: keep the first this many dimensions of the embedding, then normalize
    (Matryoshka embeddings; embed and token_embed). ``normalize``: L2-normalize the
    embedding (embed, token_embed; default True). ``use_activation`` (its older names
    ``softmax`` and ``activation`` are accepted): apply the classifier's softmax (sigmoid
    for one label) (classify, score, token_classify; default True).

    ``task`` and ``pooling_type`` are set by the intake (the `LLM` method called and the
    model's pooler); a value given for a task that does not take it is a
    `VLLMValidationError` naming the field.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Set by the intake: the task, and how the model's pooler pools it.
    task: str | None = None
    pooling_type: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_dimensions("PoolingParams", self.dimensions)
        _check_bool("PoolingParams", "normalize", self.normalize)
        self.use_activation = _use_activation(
            "PoolingParams",
            {
                "use_activation": self.use_activation,
                "softmax": self.softmax,
                "activation": self.activation,
            },
        )
        self.softmax = self.activation = None
        if self.truncate_prompt_tokens is not None and not (
            isinstance(self.truncate_prompt_tokens, int)
            and not isinstance(self.truncate_prompt_tokens, bool)
            and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            raise VLLMValidationError(
                "PoolingParams.truncate_prompt_tokens must be None, -1 (max_model_len) or an "
                f"int >= 1, got {self.truncate_prompt_tokens!r}.",
                parameter="truncate_prompt_tokens",
                value=self.truncate_prompt_tokens,
            )
        if self.task is not None and self.task not in POOLING_TASKS:
            raise VLLMValidationError(
                f"PoolingParams.task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.",
                parameter="task",
                value=self.task,
            )

    @property
    def n(self) -> int:
        """One output per request (what a progress bar counts)."""
        return 1

    @property
    def is_token_task(self) -> bool:
        """The task returns one output per prompt token."""
        return self.task in TOKEN_TASKS

    def resolved(self, task: str, config: PoolerConfig) -> PoolingParams:
        """These params for ``task`` on a model whose pooler is ``config`` (its defaults
        filled in by `convert_defaults`): every field decided. A field that the task does
        not take is a `VLLMValidationError` naming it."""
        takes = {
            "embed": ("dimensions", "normalize"),
            "token_embed": ("dimensions", "normalize"),
            "classify": ("use_activation",),
            "score": ("use_activation",),
            "token_classify": ("use_activation",),
            "encode": (),
            "reward": (),
        }[task]
        for name in ("dimensions", "normalize", "use_activation"):
            if name not in takes and getattr(self, name) is not None:
                raise VLLMValidationError(
                    f"PoolingParams.{name}={getattr(self, name)!r} does not apply to the "
                    f"{task!r} task, which takes "
                    f"{', '.join(takes) if takes else 'no pooling parameter'}; leave it None.",
                    parameter=name,
                    value=getattr(self, name),
                )
        raw = task in RAW_TASKS
        return PoolingParams(
            dimensions=None if raw else _first(self.dimensions, config.dimensions),
            normalize=not raw and bool(_first(self.normalize, config.normalize, True)),
            use_activation=not raw
            and bool(_first(self.use_activation, config.use_activation, True)),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            task=task,
            pooling_type="ALL" if task in TOKEN_TASKS else config.pooling_type,
        )


def _first(*values: Any) -> Any:
    """The first of ``values`` that is not None (None if all are)."""
    return next((value for value in values if value is not None), None)


def convert_defaults(config: PoolerConfig, convert: str) -> PoolerConfig:
    """``config`` with the defaults of ``convert`` filled in, as vLLM's: embed pools the
    LAST token and normalizes; classify pools the LAST token and applies the activation;
    reward keeps ALL tokens, neither normalized nor activated."""
    defaults = {
        "embed": PoolerConfig("LAST", normalize=True),
        "classify": PoolerConfig("LAST", use_activation=True),
        "reward": PoolerConfig("ALL", normalize=False, use_activation=False),
    }[convert]
    return PoolerConfig(
        pooling_type=config.pooling_type or defaults.pooling_type,
        normalize=defaults.normalize if config.normalize is None else config.normalize,
        use_activation=(
            defaults.use_activation if config.use_activation is None else config.use_activation
        ),
        dimensions=config.dimensions,
    )
