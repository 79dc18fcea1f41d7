"""The intake's pooling part: which tasks an engine serves, and a pooling request's params
resolved against the model's pooler (`PoolingParams.resolved`) and its prompt truncated as
``truncate_prompt_tokens`` asks."""

from __future__ import annotations

from paged_llm.config import EngineConfig, PoolerSpec
from paged_llm.exceptions import RequestError
from paged_llm.pooling_params import POOLING_TASKS, PoolingParams

# The LLM method that runs each task, for the error that names another one.
_METHODS = {
    "embed": "embed",
    "classify": "classify",
    "score": "score",
    "token_embed": "encode(..., pooling_task='token_embed')",
    "token_classify": "encode(..., pooling_task='token_classify')",
    "encode": "encode",
    "reward": "reward",
}


def check_runner(config: EngineConfig, pooling: bool, call: str) -> None:
    """Refuse a generation on a pooling engine and a pooling call on a generating one, as
    a ValueError naming the fix."""
    if pooling and config.pooler is None:
        raise ValueError(
            f"LLM.{call} needs a pooling model, and this LLM generates (runner='generate'). "
            "Build it with LLM(model, runner='pooling') to embed, classify, score or reward."
        )
    if not pooling and config.pooler is not None:
        raise ValueError(
            f"LLM.{call} generates text, and this LLM is a pooling model "
            f"(runner='pooling', convert={config.pooler.convert!r}): it serves "
            f"{', '.join(_METHODS[task] for task in config.pooler.tasks)}. Build an LLM with "
            "runner='generate' (a *ForCausalLM model) to generate."
        )


def check_task(pooler: PoolerSpec, task: str) -> None:
    """Refuse a task the pooler does not serve, naming those it does."""
    if task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {task!r}.")
    if task not in pooler.tasks:
        fix = (
            "load a *ForSequenceClassification checkpoint (or pass convert='classify' for one)"
            if task in ("classify", "score", "token_classify")
            else "pass pooler_config=PoolerConfig(pooling_type='LAST') (or 'MEAN', 'CLS')"
            if pooler.config.pooling_type == "ALL"
            else "use convert='embed'"
        )
        raise ValueError(
            f"This pooling model (convert={pooler.convert!r}, pooling_type="
            f"{pooler.config.pooling_type!r}) cannot serve the {task!r} task; it serves "
            f"{', '.join(pooler.tasks)}. To {task}, {fix}."
        )


def resolve_pooling_params(
    config: EngineConfig, params: object, task: str, token_ids: list[int]
) -> tuple[PoolingParams, list[int]]:
    """``params`` resolved for ``task`` on this engine's pooler, and the prompt's token ids
    truncated as its ``truncate_prompt_tokens`` asks (the last k tokens kept, as vLLM)."""
    if not isinstance(params, PoolingParams):
        raise RequestError(
            f"pooling_params must be a PoolingParams, got {type(params).__name__}.",
            parameter="pooling_params",
        )
    pooler = config.pooler
    assert pooler is not None  # NOTE: check_runner ran first
    resolved = params.resolved(task, pooler.config)
    hidden_size = config.hf_config.hidden_size
    if resolved.dimensions is not None and resolved.dimensions > hidden_size:
        raise RequestError(
            f"dimensions={resolved.dimensions} is more than the model's hidden_size="
            f"{hidden_size}; ask for at most {hidden_size} dimensions.",
            parameter="dimensions",
            value=resolved.dimensions,
        )
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = config.max_model_len
    return resolved, token_ids if keep is None else token_ids[-keep:]
