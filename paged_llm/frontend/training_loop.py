"""`LLM`'s methods for a training loop (vLLM's names): new weights in place, the engine's
memory given back while the trainer needs it, and calls on every rank's model runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paged_llm.distributed.weight_transfer import WeightTransferInitInfo
from paged_llm.engine.worker import RunnerMethod
from paged_llm.frontend.llm_engine import LLMEngine, WeightsOrUpdateInfo


class TrainingLoopMethods:
    """Mixed into `LLM`: each method goes to its `LLMEngine`."""

    llm_engine: LLMEngine

    def update_weights(self, weights: WeightsOrUpdateInfo) -> None:
        """Replace some or all of the model's weights, in place, between calls.

        ``weights``: ``(name, tensor)`` pairs in transformers' parameter names, as
        ``model.named_parameters()`` or a ``state_dict`` give them (a dict works too), any
        float dtype and device (cast to the engine's). Each goes where loading would put
        it: into its slice of a packed projection (q/k/v, gate/up), its tensor-parallel
        shard on every rank, every data-parallel replica, the tied embedding (for
        ``lm_head.weight`` too), re-quantized under ``quantization="int8"`` / ``"fp8"``.

        Every pair is checked before anything changes: a name the model lacks, a wrong
        shape or a non-float tensor raises ValueError naming it, and the old weights stay.
        A pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors, GGUF) cannot take float
        weights and refuses. The prefix cache is emptied: its keys and values were
        computed with the old weights. Requests queued with ``llm_engine.add_request``
        must finish first (RuntimeError).

        Inside a weight transfer (between `start_weight_update` and
        `finish_weight_update`), ``weights`` is instead a `WeightTransferUpdateInfo` (or
        its dict: ``names``, ``dtype_names``, ``shapes``): the tensors it describes are
        received from the trainer's group now, and applied by `finish_weight_update`.
        """
        self.llm_engine.update_weights(weights)

    def init_weight_transfer_engine(
        self, init_info: WeightTransferInitInfo | dict[str, Any]
    ) -> None:
        """Join the trainer's weight-transfer group (`paged_llm.distributed.weight_transfer`:
        the trainer's `TrainerWeightSender` made it at ``master_address:master_port``, by
        default on 127.0.0.1, gloo). Blocks until both ends are in."""
        self.llm_engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Begin a weight-transfer round: `update_weights(update_info)` calls receive its
        tensors, `finish_weight_update` applies them."""
        self.llm_engine.start_weight_update()

    def finish_weight_update(self) -> None:
        """Apply the round's tensors as `update_weights` applies tensors given in memory:
        checked whole first (a bad one changes nothing), the prefix cache emptied."""
        self.llm_engine.finish_weight_update()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Give memory back until `wake_up`; the prefix cache is emptied.

        Level 1 frees the KV cache (on CUDA the weights move to host memory); level 2
        drops the weights too, for a training step that needs the memory: `wake_up`
        reads them again from the model's files, and `update_weights` then pushes the
        trained ones. Generating while asleep raises RuntimeError. ``mode`` (vLLM's):
        requests queued with ``llm_engine.add_request`` are aborted (``"abort"``); with
        ``"wait"`` or ``"keep"`` they must have finished.
        """
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Take back what `sleep` released: everything, or only ``tags`` ("weights",
        "kv_cache"), e.g. ``wake_up(["weights"])``, `update_weights`, then
        ``wake_up(["kv_cache"])``. Returns True once nothing is asleep."""
        return self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(
        self,
        method: RunnerMethod,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every rank's `ModelRunner` at once (every replica's with data
        parallelism) and return the results, rank by rank: a method name, or a function
        called as ``method(runner, *args, **kwargs)``. With tensor-parallel workers the
        method and its arguments travel by pickle (a module-level function, not a
        lambda). An exception on any rank is raised here; the workers live on."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """``func(model)`` on every rank's model (paged_llm's own modules, not
        transformers'); the results by rank."""
        return self.llm_engine.apply_model(func)
