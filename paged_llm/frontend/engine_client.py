"""`EngineClient`: what the front end drives, whichever engine runs the requests.

Three clients answer it: an `EngineCore` in this process, the same engine with tensor-parallel
worker processes behind its executor, and a `DataParallelEngine` that spreads requests over
replica processes (each an `EngineCore` built by `build_engine`).
"""

from __future__ import annotations

from typing import Any, Protocol

from paged_llm.config import EngineConfig
from paged_llm.engine.core import EngineCore, EngineMetrics
from paged_llm.engine.request import EngineRequest
from paged_llm.engine.weight_updates import NamedTensors
from paged_llm.engine.worker import RunnerMethod
from paged_llm.engine_args import EngineArgs
from paged_llm.frontend.model_info import ModelInfo
from paged_llm.metrics import Metric
from paged_llm.outputs import EngineOutput


class RequestsLostError(RuntimeError):
    """No engine is left to run ``request_ids`` (every data-parallel replica has ended); the
    message names each one lost and why it ended."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class EngineClient(Protocol):
    """The engine loop as the front end sees it."""

    def add_request(self, request: EngineRequest) -> object:
        """Queue a validated request."""
        ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[EngineOutput]:
        """Run until some requests finish (one step in process); return those that did.
        Raises `RequestsLostError` for requests no engine is left to run."""
        ...

    def abort_all(self) -> None:
        """Drop every unfinished request and release what it holds."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop these requests (unknown or finished ids are ignored); they report nothing."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while requests run."""
        ...

    def collective_rpc(
        self, method: RunnerMethod, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every rank's model runner (every replica's); the results."""
        ...

    def update_weights(self, weights: NamedTensors) -> None:
        """New weights everywhere, checked before anything changes; prefix cache reset."""
        ...

    def sleep(self, level: int) -> None:
        """Release the KV cache (level 2: and the weights); requests refused until woken."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def sleeping(self) -> frozenset[str]:
        """What is asleep: "weights", "kv_cache", both or none."""
        ...

    def get_metrics(self) -> EngineMetrics: ...

    def get_stat_metrics(self, model_name: str) -> list[Metric]:
        """vLLM's metrics, one series per name and engine, labelled with ``model_name``
        and the engine's index (``engine``)."""
        ...

    def shutdown(self) -> None:
        """Free the KV cache and the weights, and end any worker process."""
        ...


def build_engine(args: EngineArgs) -> EngineCore:
    """An engine with ``args`` (a data-parallel replica's, in its process): the model's
    files read and the settings resolved as `LLM` does, without an `LLM`."""
    info = ModelInfo.load(args)
    config = EngineConfig.create(info.model_dir, info.hf_config, args)
    return EngineCore(config, info.tokenizer, info.eos_token_ids)
