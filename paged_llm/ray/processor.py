"""`ProcessorConfig` and `build_processor`: a Ray Data dataset through one `LLM` per actor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray.data
import torch

from paged_llm.engine_args import EngineArgs
from paged_llm.exceptions import RequestError, VLLMValidationError
from paged_llm.inputs import TokensPrompt
from paged_llm.jobs.lora_modules import LoRAModules
from paged_llm.jobs.requests import (
    GENERATE,
    POOLING_JOB_TASKS,
    JobRequest,
    chat_prompt,
    run_requests,
    sampling_params_over,
)
from paged_llm.llm import LLM
from paged_llm.outputs import PoolingRequestOutput, RequestOutput
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import SamplingParams

Row = dict[str, Any]
# What an actor does with one batch of rows, given its LLM: the output rows.
BatchFn = Callable[[LLM, list[Row]], list[Row]]

# The columns a row gives its prompt in, after preprocess (exactly one of them).
PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")


@dataclass(frozen=True)
class ProcessorConfig:
    """How a dataset runs on the cluster (the fields of ``ray.data.llm``'s config that apply).

    Args:
        model_source: What `LLM` takes as its model: a model directory, a ``.gguf`` file or
            a hub id in the local cache, reachable at the same path on every node.
        engine_kwargs: `LLM` keyword arguments (any `EngineArgs` field: ``dtype``,
            ``max_model_len``, ``tensor_parallel_size``, ...), checked here on the driver.
        concurrency: How many engine actors (replicas) run, each with its own `LLM`.
        batch_size: Rows handed to an actor at a time; they run as one `LLM.generate` call,
            so continuous batching and prefix caching work across them.
        num_cpus_per_actor: CPUs Ray reserves for each actor; on CPU the actor's torch takes
            as many threads (at least one).
        num_gpus_per_actor: GPUs Ray reserves for each actor (0: the actor sees none and
            runs on CPU); at least ``tensor_parallel_size`` x ``data_parallel_size``.
        lora_modules: LoRA adapters by name -> path (a PEFT folder at the same path on every
            node); a row's ``lora`` column names the one it runs under. Ids are 1, 2, ... in
            this order, and any adapter turns ``enable_lora`` on (``max_loras`` and
            ``max_lora_rank`` in ``engine_kwargs``, as for `LLM`).
        task: ``"generate"`` (a completion per row), or a pooling task: ``"embed"`` (an
            ``embedding`` column) or ``"classify"`` (``probs``), which builds each actor's
            `LLM` with ``runner="pooling"``.
    """

    model_source: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64
    num_cpus_per_actor: float = 1
    num_gpus_per_actor: float = 0
    lora_modules: dict[str, str] = field(default_factory=dict)
    task: str = GENERATE

    def __post_init__(self) -> None:
        if self.task != GENERATE and self.task not in POOLING_JOB_TASKS:
            raise ValueError(
                f"ProcessorConfig.task must be {GENERATE!r} or one of "
                f"{', '.join(map(repr, POOLING_JOB_TASKS))}, got {self.task!r}."
            )
        for name in ("concurrency", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProcessorConfig.{name} must be an integer >= 1, got {value!r}.")
        for name in ("num_cpus_per_actor", "num_gpus_per_actor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ProcessorConfig.{name} must be a number >= 0, got {value!r}.")
        # NOTE: on the driver, so that a bad setting fails before any actor starts.
        args = EngineArgs.from_kwargs(self.llm_kwargs())
        devices = args.tensor_parallel_size * args.data_parallel_size
        if 0 < self.num_gpus_per_actor < devices:
            raise ValueError(
                f"ProcessorConfig.num_gpus_per_actor={self.num_gpus_per_actor}, but each actor's "
                f"LLM needs {devices} devices (tensor_parallel_size x data_parallel_size); "
                f"reserve {devices}."
            )

    @property
    def adapters(self) -> LoRAModules:
        """The LoRA adapters rows may name in their ``lora`` column."""
        return LoRAModules(self.lora_modules, "ProcessorConfig.lora_modules")

    def llm_kwargs(self) -> dict[str, Any]:
        """Each actor's `LLM` keyword arguments."""
        kwargs = dict(self.engine_kwargs)
        if self.task in POOLING_JOB_TASKS:
            if kwargs.get("runner", "pooling") not in ("pooling", "auto"):
                raise ValueError(
                    f"ProcessorConfig(task={self.task!r}) runs a pooling model, and "
                    f"engine_kwargs has runner={kwargs['runner']!r}: leave runner out."
                )
            kwargs["runner"] = "pooling"
        return self.adapters.llm_kwargs(kwargs)


class _LLMActor:
    """One Ray Data actor: builds its `LLM` once, then runs batch after batch through it."""

    def __init__(
        self, model_source: str, engine_kwargs: dict[str, Any], num_threads: int, fn: BatchFn
    ) -> None:
        # NOTE: no more threads than the CPUs Ray reserved: the node's other actors use the
        # rest, and OpenMP threads that wait on each other make every step many times slower.
        torch.set_num_threads(num_threads)
        self._llm = LLM(model_source, **engine_kwargs)
        self._fn = fn

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = self._fn(self._llm, batch.to_pylist())
        # NOTE: the columns of every row (Table.from_pylist takes the first row's only), in
        # one table returned whole: a batch whose actor dies is retried on another and
        # emits nothing twice.
        columns = dict.fromkeys(column for row in rows for column in row)
        return pa.table({column: [row.get(column) for row in rows] for column in columns})


def map_with_llm(
    dataset: ray.data.Dataset, config: ProcessorConfig, fn: BatchFn
) -> ray.data.Dataset:
    """``fn(llm, rows)`` over every batch of ``dataset``, in a pool of ``config.concurrency``
    actors that each hold one `LLM`.

    Ray restarts an actor that dies and retries its batch (Ray Data's defaults for actor
    pools: unlimited restarts and task retries), so every row comes out once.
    """
    return dataset.map_batches(
        _LLMActor,
        fn_constructor_kwargs={
            "model_source": config.model_source,
            "engine_kwargs": config.llm_kwargs(),
            "num_threads": max(1, int(config.num_cpus_per_actor)),
            "fn": fn,
        },
        batch_size=config.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=config.concurrency),
        num_cpus=config.num_cpus_per_actor,
        num_gpus=config.num_gpus_per_actor,
    )


@dataclass(frozen=True)
class Processor:
    """A dataset in, the generated dataset out (lazily, as Ray Data does): see
    `build_processor`."""

    config: ProcessorConfig
    preprocess: Callable[[Row], Row] | None = None
    postprocess: Callable[[Row], Row] | None = None

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        return map_with_llm(dataset, self.config, self._run_batch)

    def _run_batch(self, llm: LLM, rows: list[Row]) -> list[Row]:
        if self.preprocess is not None:
            rows = [{**row, **self.preprocess(row)} for row in rows]
        results: list[Row] = [{} for _ in rows]
        adapters, task = self.config.adapters, self.config.task
        requests = [_request(llm, row, adapters, task) for row in rows]
        for position, result in run_requests(llm, requests, progress=False, task=task):
            if isinstance(result, RequestError):
                results[position] = _failed(task, result.reason)
            elif isinstance(result, RequestOutput):
                results[position] = _generated(result)
            else:
                results[position] = _pooled(task, result)
        done = [{**row, **result} for row, result in zip(rows, results, strict=True)]
        return done if self.postprocess is None else [self.postprocess(row) for row in done]


def build_processor(
    config: ProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
) -> Processor:
    """A processor that generates a completion for every row of a dataset (or, under
    ``config.task`` "embed" or "classify", pools it).

    ``preprocess(row)`` gives the request's columns, merged over the row: ``prompt`` (text),
    ``messages`` (a chat, rendered with the model's template; not for pooling) or
    ``prompt_token_ids``, and ``sampling_params`` (a dict of `SamplingParams` fields over
    the model's defaults; a null field is unset, as Arrow fills the fields a row lacks with
    nulls) or for pooling ``pooling_params`` (a dict of `PoolingParams` fields:
    ``dimensions``, ``normalize``, ``truncate_prompt_tokens``, ...), and ``lora`` (the name
    of an adapter of ``config.lora_modules``; null: the base model). The processor adds
    ``generated_text``, ``generated_token_ids``, ``num_generated_tokens``,
    ``num_prompt_tokens``, ``finish_reason`` and ``error`` (for pooling: ``embedding`` or
    ``probs``, a list of floats, ``num_prompt_tokens`` and ``error``), and
    ``postprocess(row)`` maps the result to the output row; without it, every column comes
    out.

    A row that cannot run (its prompt longer than ``max_model_len``, invalid sampling
    params, malformed messages, an adapter name not registered) gets ``error`` set and an
    empty output; the other rows of its batch, and the job, go on. Exceptions that
    ``preprocess`` or ``postprocess`` raise fail the job, as in any Ray Data ``map``.
    """
    return Processor(config, preprocess, postprocess)


def _request(llm: LLM, row: Row, adapters: LoRAModules, task: str) -> JobRequest | RequestError:
    """A row's prompt, sampling (or pooling) params and adapter, or why the row cannot
    run."""
    given = [column for column in PROMPT_COLUMNS if row.get(column) is not None]
    if len(given) != 1:
        return RequestError(
            f"a row needs exactly one of {', '.join(PROMPT_COLUMNS)} after preprocess, got "
            f"{', '.join(given) if given else 'none'}"
        )
    params_column = "sampling_params" if task == GENERATE else "pooling_params"
    values = row.get(params_column) or {}
    if not isinstance(values, dict):
        kind = "SamplingParams" if task == GENERATE else "PoolingParams"
        return RequestError(
            f"{params_column} must be a dict of {kind} fields, got {values!r}",
            parameter=params_column,
        )
    given_values = {name: value for name, value in values.items() if value is not None}
    try:
        params = (
            _sampling_params(llm, given_values)
            if task == GENERATE
            else _pooling_params(given_values)
        )
        lora = adapters.select(row.get("lora"), "lora")
        column = given[0]
        value = row[column]
        if column == "messages":
            if task != GENERATE:
                raise RequestError(
                    f"the {task!r} task takes a prompt or prompt_token_ids, not messages",
                    parameter="messages",
                )
            return JobRequest(chat_prompt(llm, list(value)), params, lora)
        if column == "prompt_token_ids":
            return JobRequest(TokensPrompt(prompt_token_ids=list(value)), params, lora)
        if not isinstance(value, str):
            raise RequestError(
                f"prompt must be a str, got {type(value).__name__}", parameter="prompt"
            )
        return JobRequest(value, params, lora)
    except RequestError as error:
        return error


def _sampling_params(llm: LLM, values: dict[str, Any]) -> SamplingParams:
    params = sampling_params_over(llm.get_default_sampling_params(), values)
    if params.n != 1:
        raise RequestError(
            f"sampling_params n={params.n}: a row gets one completion; repeat the row instead",
            parameter="n",
        )
    return params


def _pooling_params(values: dict[str, Any]) -> PoolingParams:
    try:
        return PoolingParams(**values)
    except TypeError as error:
        raise RequestError(f"invalid pooling_params: {error}", parameter="pooling_params") from None
    except VLLMValidationError as error:
        raise RequestError.of(error) from None


def _generated(output: RequestOutput) -> Row:
    (completion,) = output.outputs
    return {
        "generated_text": completion.text,
        "generated_token_ids": list(completion.token_ids),
        "num_generated_tokens": len(completion.token_ids),
        "num_prompt_tokens": len(output.prompt_token_ids),
        "finish_reason": completion.finish_reason,
        "error": None,
    }


def _pooled(task: str, output: PoolingRequestOutput[Any]) -> Row:
    return {
        POOLING_JOB_TASKS[task]: output.outputs.data.tolist(),
        "num_prompt_tokens": len(output.prompt_token_ids),
        "error": None,
    }


def _failed(task: str, error: str) -> Row:
    if task != GENERATE:
        return {POOLING_JOB_TASKS[task]: None, "num_prompt_tokens": 0, "error": error}
    return {
        "generated_text": "",
        "generated_token_ids": [],
        "num_generated_tokens": 0,
        "num_prompt_tokens": 0,
        "finish_reason": None,
        "error": error,
    }
