"""LoRA adapters in the engine: which slot each adapter of a step takes, and the slots
themselves.

Rank 0 plans (`LoRASlotTable`): the adapters of a step's sequences (at most ``max_loras``,
the scheduler's rule) keep the slots they hold, and one that holds none takes the least
recently used slot, to be loaded before the step runs. Every rank then follows the plan
(`LoRAModelSlots`): an adapter is read from its files once into host memory (an LRU cache of
``max_cpu_loras``) and copied into the slot of each adapted projection, this rank's shard of
it; loading costs the adapter's size, never a rebuild. Adapters travel between processes by
their `LoRARequest`, so each rank and each data-parallel replica reads them itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from torch import nn

from paged_llm.config import EngineConfig, LoRAConfig
from paged_llm.engine.scheduler import ScheduledBatch
from paged_llm.inputs import LoRARequest
from paged_llm.layers.linear import Linear
from paged_llm.layers.lora import LoRABatch, LoRASlots, LoRAState
from paged_llm.model_files.lora_adapter import (
    LORA_TARGET_MODULES,
    LoRAAdapter,
    load_lora_adapter,
)


@dataclass(frozen=True, slots=True)
class LoRAStepPlan:
    """The adapters one step uses: what to load into which slot first, and the slot of each
    of the step's tokens (-1: the base model)."""

    loads: list[tuple[int, LoRARequest]]
    token_slots: np.ndarray  # [T] int64


class LoRASlotTable:
    """Rank 0's record of which adapter each slot holds, and when each was last used."""

    def __init__(self, max_loras: int) -> None:
        self._lora_ids: list[int | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._num_steps = 0

    def plan(self, batch: ScheduledBatch) -> LoRAStepPlan | None:
        """The step's plan; None when none of its sequences uses an adapter."""
        requests = [seq.request.lora_request for seq in batch.seqs]
        wanted = {request.lora_int_id: request for request in requests if request is not None}
        if not wanted:
            return None
        assert len(wanted) <= len(self._lora_ids), "the scheduler admits at most max_loras"
        self._num_steps += 1
        slot_of = {
            lora_id: slot for slot, lora_id in enumerate(self._lora_ids) if lora_id in wanted
        }
        # Empty slots first, then the least recently used.
        free = sorted(
            (slot for slot, lora_id in enumerate(self._lora_ids) if lora_id not in wanted),
            key=lambda slot: (self._lora_ids[slot] is not None, self._last_used[slot]),
        )
        loads = []
        for lora_id, request in wanted.items():
            if lora_id not in slot_of:
                slot = free.pop(0)
                self._lora_ids[slot] = lora_id
                slot_of[lora_id] = slot
                loads.append((slot, request))
            self._last_used[slot_of[lora_id]] = self._num_steps
        seq_slots = np.asarray(
            [-1 if r is None else slot_of[r.lora_int_id] for r in requests], dtype=np.int64
        )
        return LoRAStepPlan(loads, np.repeat(seq_slots, batch.num_scheduled_tokens))


def adapted_projections(model: nn.Module) -> dict[str, Linear]:
    """The model's projections that adapters can target, by module name (packed ones under
    their packed name: ``...self_attn.qkv_proj``)."""
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    names = {packed.get(target, (target, 0))[0] for target in LORA_TARGET_MODULES}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in names
    }


class LoRAModelSlots:
    """The adapter slots of one rank's model, and the adapters read into host memory."""

    def __init__(self, model: nn.Module, config: EngineConfig, lora: LoRAConfig) -> None:
        self.config = config
        self.lora = lora
        self.state = LoRAState(use_triton=config.platform.triton_linear)
        self.packed_modules: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
        self.slots: dict[str, LoRASlots] = {}
        for name, module in adapted_projections(model).items():
            module.lora = LoRASlots(
                self.state,
                module.lora_shard(),
                lora.max_loras,
                lora.max_lora_rank,
                config.dtype,
                config.device,
            )
            self.slots[name] = module.lora
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def begin_step(self, plan: LoRAStepPlan | None) -> None:
        """Load what the plan asks, and tell the layers each token's slot."""
        if plan is None:
            self.state.batch = None
            return
        for slot, request in plan.loads:
            self._load(slot, request)
        self.state.batch = LoRABatch.from_token_slots(plan.token_slots, self.config.device)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._adapters.pop(request.lora_int_id, None)
        if adapter is None:
            adapter = load_lora_adapter(
                request.lora_path, self.lora.max_lora_rank, self.config.hf_config
            )
            if len(self._adapters) == self.lora.max_cpu_loras:
                self._adapters.popitem(last=False)
        self._adapters[request.lora_int_id] = adapter
        return adapter

    def _load(self, slot: int, request: LoRARequest) -> None:
        adapter = self._adapter(request)
        for slots in self.slots.values():
            slots.clear(slot)
        dtype = self.config.dtype
        for module_name, weights in adapter.modules.items():
            prefix, target = module_name.rsplit(".", 1)
            projection, slice_index = self.packed_modules.get(target, (target, 0))
            self.slots[f"{prefix}.{projection}"].load(
                slot, slice_index, weights.lora_a.to(dtype), weights.lora_b.to(dtype)
            )
