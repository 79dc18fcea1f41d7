"""`LLMEngine`: vLLM's offline engine loop, and the engine every `LLM` drives.

It holds what one model's requests pass through: the model's files (`ModelInfo`), the
resolved settings (`EngineConfig`), the intake (`InputProcessor`) and the engine client
that runs requests (one engine in this process, with or without tensor-parallel workers,
or data-parallel replicas). `LLM` builds one and drives it whole batches at a time; a
script written for vLLM's ``LLMEngine`` drives it one step at a time::

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():
            ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from paged_llm.config import EngineConfig, ModelConfig
from paged_llm.distributed.weight_transfer import (
    EngineWeightReceiver,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    is_update_info,
)
from paged_llm.engine.core import EngineCore
from paged_llm.engine.worker import RunnerMethod, apply_to_model
from paged_llm.engine_args import EngineArgs
from paged_llm.frontend.data_parallel import DataParallelEngine
from paged_llm.frontend.engine_client import EngineClient, build_engine
from paged_llm.frontend.input_processor import InputProcessor, RejectedRequest
from paged_llm.frontend.model_info import ModelInfo
from paged_llm.frontend.pooling_requests import check_task
from paged_llm.inputs import LoRARequest, PromptType
from paged_llm.metrics import Metric
from paged_llm.outputs import EngineOutput
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import RequestOutputKind, SamplingParams

# What `update_weights` takes: tensors by name, or a weight-transfer round's description.
WeightsOrUpdateInfo = (
    Mapping[str, torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | WeightTransferUpdateInfo
    | dict[str, Any]
)


class LLMEngine:
    """One model's engine, as vLLM's ``LLMEngine``: `add_request`, `step`,
    `has_unfinished_requests`, `abort_request`.

    `step` returns outputs as each request's ``SamplingParams.output_kind`` asks (by
    default everything so far, after every step); a request's last output is the one
    `LLM.generate` gives for the same prompt and params.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_info = info = ModelInfo.load(args)
        self.config = EngineConfig.create(info.model_dir, info.hf_config, args)
        self.model_config: ModelConfig = self.config.model_config
        self.processor = InputProcessor(info, self.config)
        self.engine_core: EngineClient | None = self._engine_client()
        # Ids of the requests `add_request` queued that have not been reported finished.
        self._unfinished: set[str] = set()
        # The trainer's weight-transfer group once joined, and the tensors received in the
        # weight update under way (None: none is).
        self._weight_receiver: EngineWeightReceiver | None = None
        self._received: list[tuple[str, torch.Tensor]] | None = None

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        usage_context: object = None,
        stat_loggers: list[Any] | None = None,
        enable_multiprocessing: bool = False,
    ) -> LLMEngine:
        """The engine of ``engine_args``. vLLM's ``usage_context`` (telemetry) and
        ``enable_multiprocessing`` (the engine core in a process of its own) change nothing
        a script can see and are accepted; custom ``stat_loggers`` are refused: read
        `get_metrics` instead."""
        if stat_loggers:
            raise ValueError(
                "stat_loggers are not supported by paged_llm: read LLMEngine.get_metrics() "
                "(vLLM's metric objects) after or between steps instead."
            )
        return cls(engine_args)

    def _engine_client(self) -> EngineClient:
        info, args, config = self.model_info, self.args, self.config
        if args.data_parallel_size == 1:
            return EngineCore(config, info.tokenizer, info.eos_token_ids)
        # NOTE: a replica loads the resolved directory, which has no revisions, and takes
        # the seed drawn here for seed=None.
        replica_args = replace(
            args, model=info.model_dir, data_parallel_size=1, revision=None, seed=config.seed
        )
        return DataParallelEngine(
            functools.partial(build_engine, replica_args),
            num_replicas=args.data_parallel_size,
            seed=config.seed,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            tensor_parallel_size=args.tensor_parallel_size,
            devices=config.platform.replica_devices(),
        )

    def live_engine(self) -> EngineClient:
        """The engine client; RuntimeError once `shutdown` has run."""
        if self.engine_core is None:
            raise RuntimeError("This engine was shut down; create a new one to generate.")
        return self.engine_core

    def awake_engine(self) -> EngineClient:
        """The engine client, for requests: RuntimeError while `sleep` holds part of it
        (refused here, before any request reaches an engine or a replica)."""
        engine = self.live_engine()
        asleep = engine.sleeping()
        if asleep:
            raise RuntimeError(
                f"This engine is asleep ({', '.join(sorted(asleep))} released by sleep()): "
                "call wake_up() before running requests."
            )
        return engine

    # ----- vLLM's offline loop ----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        """Validate one request and queue it; the next `step` runs it.

        Raises a `RequestError` (a ValueError) for a request the engine cannot run (the
        same checks as `LLM.generate`), and ValueError for an ``request_id`` that is still
        unfinished. ``arrival_time`` and ``trace_headers`` are accepted for vLLM's
        signature and not used. ``lora_request`` runs the request under that adapter
        (``enable_lora=True``).

        A `PoolingParams` (on a ``runner="pooling"`` engine) queues a pooling request for
        ``params.task`` (vLLM's default where unset: the per-token task the model serves);
        `step` reports it once, finished, as a `PoolingRequestOutput`.
        """
        engine = self.awake_engine()
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise ValueError(f"arrival_time must be a number of seconds, got {arrival_time!r}.")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}.")
        if request_id in self._unfinished:
            raise ValueError(
                f"Request id {request_id!r} is already running; give each request its own id."
            )
        if isinstance(params, PoolingParams):
            (processed,) = self.processor.process_pooling(
                [prompt],
                [params],
                self._pooling_task(params),
                tokenization_kwargs=tokenization_kwargs,
                lora_requests=[lora_request],
            )
            output_kind = RequestOutputKind.FINAL_ONLY
        elif isinstance(params, SamplingParams):
            (processed,) = self.processor.process(
                [prompt],
                [params],
                priority=[priority],
                tokenization_kwargs=tokenization_kwargs,
                lora_requests=[lora_request],
            )
            output_kind = params.output_kind
        else:
            raise ValueError(
                f"params must be a SamplingParams or a PoolingParams, got "
                f"{type(params).__name__}: LLMEngine runs generation and pooling requests "
                "(beam search is LLM.beam_search)."
            )
        if isinstance(processed, RejectedRequest):
            raise processed.error
        engine.add_request(replace(processed, request_id=request_id, output_kind=output_kind))
        self._unfinished.add(request_id)

    def _pooling_task(self, params: PoolingParams) -> str:
        """``params.task``, or vLLM's default for a pooling request without one: the
        per-token task the pooler serves (``token_embed``, else ``token_classify``)."""
        pooler = self.config.pooler
        if pooler is None:
            raise ValueError(
                "A PoolingParams request needs a pooling model, and this engine generates "
                "(runner='generate'). Build it with EngineArgs(model, runner='pooling') to "
                "embed, classify, score or reward."
            )
        task = params.task or next(
            (t for t in ("token_embed", "token_classify") if t in pooler.tasks), None
        )
        if task is None:
            raise ValueError(
                f"PoolingParams.task is not set, and this pooling model serves no per-token "
                f"task to default to; set task to one of {', '.join(pooler.tasks)}."
            )
        check_task(pooler, task)
        return task

    def step(self) -> list[EngineOutput]:
        """Run one engine step (with data parallelism: until some request finishes); the
        outputs it produced, as `SamplingParams.output_kind` asks: for ``CUMULATIVE``
        (the default) and ``DELTA`` requests one output per step that added tokens
        (``finished`` False until the last), for ``FINAL_ONLY`` ones one output when they
        finish."""
        engine = self.live_engine()
        if not engine.has_unfinished():
            return []
        outputs = engine.step()
        self._unfinished.difference_update(
            output.request_id for output in outputs if output.finished
        )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core is not None and self.engine_core.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests queued with `add_request` and not yet returned by `step`."""
        return len(self._unfinished)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop these requests (one id or several; unknown and finished ids are ignored):
        their blocks are freed and `step` reports nothing more of them."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.live_engine().abort_requests(request_ids)
        self._unfinished.difference_update(request_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so later prompts compute their KV cache anew (after a
        weight update, or to time a cold cache). Returns False, and forgets nothing, while
        requests are running: their blocks are in use."""
        return self.live_engine().reset_prefix_cache()

    # ----- inside a training loop --------------------------------------------------------

    def update_weights(self, weights: WeightsOrUpdateInfo) -> None:
        """Replace some or all weights in place, or receive a weight-transfer round (see
        `LLM.update_weights`)."""
        if is_update_info(weights):
            if self._received is None:
                raise RuntimeError(
                    "update_weights(update_info) receives from the trainer inside a weight "
                    "update: call start_weight_update() first, finish_weight_update() after."
                )
            assert self._weight_receiver is not None
            assert isinstance(weights, (WeightTransferUpdateInfo, dict))
            update = WeightTransferUpdateInfo.of(weights)
            self._received.extend(self._weight_receiver.receive(update))
            return
        assert not isinstance(weights, WeightTransferUpdateInfo)
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        self.live_engine().update_weights(pairs)

    def init_weight_transfer_engine(
        self, init_info: WeightTransferInitInfo | dict[str, Any]
    ) -> None:
        """Join the trainer's weight-transfer group (see `LLM.init_weight_transfer_engine`)."""
        self._weight_receiver = EngineWeightReceiver(WeightTransferInitInfo.of(init_info))

    def start_weight_update(self) -> None:
        if self._weight_receiver is None:
            raise RuntimeError(
                "start_weight_update needs a weight-transfer group: call "
                "init_weight_transfer_engine(init_info) first."
            )
        if self._received is not None:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active; call "
                "finish_weight_update() first."
            )
        self._received = []

    def finish_weight_update(self) -> None:
        """Apply every tensor received since `start_weight_update`, checked whole first."""
        if self._received is None:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update()."
            )
        received, self._received = self._received, None
        self.live_engine().update_weights(received)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Release the KV cache (level 2: and the weights) until `wake_up` (see
        `LLM.sleep`)."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (release the KV cache) or 2 (the weights too), got "
                f"{level!r}. vLLM's level 0 pauses a server's scheduling; paged_llm schedules "
                "only while a call runs, so there is nothing to pause."
            )
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}.")
        engine = self.live_engine()
        if self._unfinished:
            if mode != "abort":
                raise RuntimeError(
                    f"sleep(mode={mode!r}) with {len(self._unfinished)} request(s) queued by "
                    "add_request: step them to the end first, or sleep with mode='abort'."
                )
            self.abort_request(list(self._unfinished))
        engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Take back what `sleep` released (only ``tags``, if given: "weights",
        "kv_cache"); True once nothing is asleep."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(
                f"wake_up tags must be among 'weights' and 'kv_cache', got {sorted(unknown)}."
            )
        engine = self.live_engine()
        engine.wake_up(tags)
        return not engine.sleeping()

    def is_sleeping(self) -> bool:
        return bool(self.live_engine().sleeping())

    def collective_rpc(
        self,
        method: RunnerMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``method`` on every rank's model runner (see `LLM.collective_rpc`)."""
        if timeout is not None:
            raise ValueError(
                "collective_rpc(timeout=...) is not supported: a call runs to its end on "
                "every rank (a rank that dies fails it at once)."
            )
        return self.live_engine().collective_rpc(method, tuple(args), kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``func(model)`` on every rank's model; the results by rank."""
        return self.collective_rpc(apply_to_model, args=(func,))

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics now (``vllm.v1.metrics.reader`` values: `Counter`, `Gauge`,
        `Histogram`): tokens, requests by finish reason, latencies, the KV cache, labelled
        ``model_name`` (the served model name) and ``engine`` (with data parallelism, one
        series per replica). docs/usage.md ("Metrics") lists them.

        Raises RuntimeError under ``disable_log_stats=True``, as vLLM does.
        """
        if self.args.disable_log_stats:
            raise RuntimeError(
                "get_metrics() needs the engine statistics, and this engine was built with "
                "disable_log_stats=True: pass disable_log_stats=False (the default) to read "
                "them, or use LLM.get_engine_metrics() for paged_llm's own counters."
            )
        return self.live_engine().get_stat_metrics(self.model_config.served_model_name)

    # ----- the model --------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts are encoded with; None under skip_tokenizer_init=True."""
        return self.model_info.tokenizer

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded with."""
        if self.model_info.tokenizer is None:
            raise ValueError(
                "This engine has no tokenizer: it was built with skip_tokenizer_init=True."
            )
        return self.model_info.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def shutdown(self) -> None:
        """Free the KV cache and the weights (and end any worker or replica process); the
        engine cannot run requests afterwards."""
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None
        self._weight_receiver = self._received = None
        self._unfinished.clear()
