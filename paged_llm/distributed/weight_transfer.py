"""Weights sent from a trainer's process to an engine's: vLLM's weight-transfer protocol
over a two-party ``torch.distributed`` group (gloo on CPU, NCCL between GPUs).

The trainer (rank 0) owns the rendezvous; the engine (rank ``rank_offset``, 1) joins it
with `LLM.init_weight_transfer_engine`. Each round, the trainer tells the engine what it
will send (`WeightTransferUpdateInfo`: names, dtypes, shapes, in order, however it likes:
a queue, a file, an RPC) and broadcasts the tensors in that order with `send_weights`;
the engine receives them in `LLM.update_weights(update_info)` between
`start_weight_update` and `finish_weight_update`, which applies them all at once. Both
ends bind ``127.0.0.1`` unless ``bind_address`` says otherwise.

Trainer side::

    sender = TrainerWeightSender(WeightTransferInitInfo(master_port=port))
    info = WeightTransferUpdateInfo.describing(model.named_parameters())
    queue.put(info)               # the engine's process calls update_weights(info)
    sender.send_weights(model.named_parameters())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paged_llm.distributed.group import LOOPBACK, create_store, join_store, process_group

_TRAINER_RANK = 0


@dataclass(frozen=True)
class WeightTransferInitInfo:
    """Where the trainer's group listens (vLLM's NCCL init info, plus ``backend`` and
    ``bind_address``): ``master_port`` is required."""

    master_port: int
    master_address: str = LOOPBACK
    # The engine's rank in the group, and the group's size: one trainer and one engine.
    rank_offset: int = 1
    world_size: int = 2
    backend: str = "gloo"
    # The address this side's gloo sockets bind to.
    bind_address: str = LOOPBACK

    def __post_init__(self) -> None:
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a port number, got {self.master_port!r}.")
        if (self.rank_offset, self.world_size) != (1, 2):
            raise ValueError(
                "paged_llm's weight transfer is one trainer (rank 0) and one engine (rank 1): "
                f"rank_offset=1 and world_size=2, got {self.rank_offset} and "
                f"{self.world_size}. With tensor or data parallelism, the engine's front sends "
                "the weights on to every rank and replica itself."
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}.")

    @classmethod
    def of(cls, value: WeightTransferInitInfo | dict[str, Any]) -> WeightTransferInitInfo:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "init_info must be a WeightTransferInitInfo or a dict of its fields, got "
                f"{type(value).__name__}."
            )
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"Unknown weight-transfer init_info key(s) {unknown}; known: "
                f"{', '.join(cls.__dataclass_fields__)}."
            )
        return cls(**value)

    @property
    def device(self) -> torch.device:
        """Where the tensors travel from and to: NCCL moves device tensors only."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@dataclass(frozen=True)
class WeightTransferUpdateInfo:
    """One round's tensors, in the order the trainer broadcasts them (vLLM's names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info needs one dtype and one shape per name: got {len(self.names)} "
                f"names, {len(self.dtype_names)} dtypes and {len(self.shapes)} shapes."
            )
        for name, dtype in zip(self.names, self.dtype_names, strict=True):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"update_info: {name!r} has dtype {dtype!r}, not a torch dtype.")

    @classmethod
    def of(cls, value: WeightTransferUpdateInfo | dict[str, Any]) -> WeightTransferUpdateInfo:
        if isinstance(value, WeightTransferUpdateInfo):
            return value
        return cls(list(value["names"]), list(value["dtype_names"]), list(value["shapes"]))

    @classmethod
    def describing(
        cls, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> WeightTransferUpdateInfo:
        """The update info of sending ``named_tensors`` in this order."""
        pairs = list(named_tensors)
        return cls(
            [name for name, _ in pairs],
            [str(tensor.dtype).removeprefix("torch.") for _, tensor in pairs],
            [list(tensor.shape) for _, tensor in pairs],
        )


def is_update_info(value: object) -> bool:
    """Whether ``value`` is a weight-transfer round's info rather than tensors."""
    return isinstance(value, WeightTransferUpdateInfo) or (
        isinstance(value, dict) and set(value) == {"names", "dtype_names", "shapes"}
    )


class _Party:
    """One end of the two-party group."""

    def __init__(self, info: WeightTransferInitInfo, rank: int) -> None:
        self.info = info
        size = info.world_size
        if rank == _TRAINER_RANK:
            self.store = create_store(size, info.master_address, info.master_port)
        else:
            self.store = join_store(info.master_port, size, info.master_address)
        prefixed = dist.PrefixStore("weight_transfer", self.store)
        self.group = process_group(info.backend, rank, size, prefixed, info.bind_address)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = _TRAINER_RANK
        self.group.broadcast([tensor], options).wait()


class TrainerWeightSender(_Party):
    """The trainer's end: creates the group (blocks until the engine joins it)."""

    def __init__(self, info: WeightTransferInitInfo | dict[str, Any]) -> None:
        super().__init__(WeightTransferInitInfo.of(info), _TRAINER_RANK)

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast the tensors, in order, to the engine receiving their update info."""
        for _, tensor in named_tensors:
            self._broadcast(tensor.detach().to(self.info.device).contiguous())


class EngineWeightReceiver(_Party):
    """The engine's end: joins the trainer's group."""

    def __init__(self, info: WeightTransferInitInfo) -> None:
        super().__init__(info, info.rank_offset)

    def receive(self, update: WeightTransferUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        """The tensors ``update`` describes, as the trainer broadcasts them."""
        received = []
        for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.info.device)
            self._broadcast(tensor)
            received.append((name, tensor))
        return received
