"""The tensor-parallel group: the ranks one model is split over, and their collectives.

A real ``torch.distributed`` process group (gloo on CPU, NCCL on GPU), built from its own
TCPStore rather than through ``init_process_group``: that leaves the user's process free
of global distributed state, so several engines can live side by side and shut down
cleanly. The ranks of a group are processes of one machine: the store and gloo listen on
127.0.0.1 only (NCCL's own bootstrap sockets follow ``NCCL_SOCKET_IFNAME``).
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
# A collective waits at most this long for its peers. Ranks run the same work, so a long
# wait means a peer is gone; a dead peer usually closes its sockets, which fails at once.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
_STORE_TIMEOUT = datetime.timedelta(seconds=60)


class TensorParallelGroup:
    """Rank ``rank`` of ``size``; with size 1 every collective is the identity."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        process_group: Any = None,
        backend: str = "gloo",
    ) -> None:
        self.rank = rank
        self.size = size
        self._group = process_group
        self._backend = backend
        # Wall time spent in collectives, waiting for slower peers included.
        self.collective_seconds = 0.0

    def _run(self, work: dist.Work) -> None:
        """Wait for an issued collective, and count the wait."""
        started = time.perf_counter()
        work.wait()
        self.collective_seconds += time.perf_counter() - started

    @property
    def is_first(self) -> bool:
        """Rank 0, which schedules and samples."""
        return self.rank == 0

    def shard_range(self, total: int) -> tuple[int, int]:
        """``(start, size)`` of this rank's share of ``total`` rows, ``total`` divisible."""
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self._group is not None:
            self._run(self._group.allreduce([tensor]))
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        if self._group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._collective_device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._group.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` concatenated along the last dimension, on rank 0 only."""
        if self._group is None:
            return tensor
        tensor = tensor.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.is_first:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self._run(self._group.gather([parts], [tensor], opts))
            return torch.cat(parts, dim=-1)
        self._run(self._group.gather([], [tensor], opts))
        return None

    @property
    def _collective_device(self) -> torch.device:
        # NCCL reduces device tensors only.
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @classmethod
    def connect(
        cls, backend: str, rank: int, size: int, store: dist.TCPStore
    ) -> TensorParallelGroup:
        """Join the group whose rendezvous is ``store`` (rank 0 created it)."""
        group = process_group(backend, rank, size, dist.PrefixStore("tp", store))
        return cls(rank, size, group, backend)


def process_group(
    backend: str, rank: int, size: int, store: dist.Store, host: str = LOOPBACK
) -> Any:
    """A process group of ``backend`` ("gloo" or "nccl") over ``store``, outside
    ``init_process_group``; gloo's sockets bind to ``host``."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = COLLECTIVE_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def create_store(size: int, host: str = LOOPBACK, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous on ``host:port`` (by default a free loopback port:
    ``store.port``)."""
    # NOTE: TCPStore binds its own listener to every interface (::), whatever host it is
    # given; a socket bound to ``host`` here and handed over keeps it off other networks.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            size,
            is_master=True,
            wait_for_workers=False,
            timeout=_STORE_TIMEOUT,
            master_listen_fd=listener.fileno(),
            # libuv's server owns the descriptor from here on and closes it with the store.
            use_libuv=True,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


def join_store(port: int, size: int, host: str = LOOPBACK) -> dist.TCPStore:
    """A worker's handle on rank 0's rendezvous."""
    return dist.TCPStore(host, port, size, is_master=False, timeout=_STORE_TIMEOUT)
