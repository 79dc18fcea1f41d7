"""Data-parallel placement, in pure functions: each request's cost, seed and replica, and
each replica's cores and devices."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import BeamSearchParams, SamplingParams
from paged_llm.seeds import request_seed


def request_cost(
    num_prompt_tokens: int,
    params: SamplingParams | BeamSearchParams | PoolingParams,
    max_model_len: int,
) -> int:
    """Tokens a request makes its replica process: the prompt, and up to ``max_tokens`` for
    each of its ``n`` sequences or beams (``max_tokens=None`` runs up to
    ``max_model_len``); a pooling request's prompt only."""
    if isinstance(params, PoolingParams):
        return num_prompt_tokens
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    return num_prompt_tokens + max_tokens * params.n


def resolve_seed(
    params: SamplingParams | BeamSearchParams | PoolingParams, engine_seed: int, serial: int
) -> SamplingParams | BeamSearchParams | PoolingParams:
    """``params`` with the base seed that a single `EngineCore` seeded ``engine_seed`` draws
    for its arrival number ``serial`` (`request_seed`), when the request has no seed of its
    own. Fixed by the front, it makes a request's tokens independent of which replica runs
    it and of that replica's own arrival count."""
    # NOTE: a beam search has no seed to fix (as in vLLM): its draws above temperature 0
    # follow the replica's own arrival count. A pooling request draws nothing.
    if isinstance(params, (BeamSearchParams, PoolingParams)) or params.seed is not None:
        return params
    return replace(params, seed=request_seed(engine_seed, serial))


def assign_replicas(
    prompts: Sequence[list[int]],
    costs: Sequence[int],
    loads: Sequence[int],
    block_size: int,
) -> list[int]:
    """The replica (an index into ``loads``) of each request, so that the replicas finish
    together and prompts that can share KV blocks run on the same replica.

    Requests whose prompts start with the same full KV block form a prefix group (a prompt
    shorter than one block shares nothing and is a group of its own). Groups are placed
    costliest first, as in longest-processing-time scheduling, each on the least-loaded
    replica; its members follow in token order (so those sharing the longest prefixes are
    neighbours) and stay on that replica while it has room within the fair share
    ``(sum(loads) + sum(costs)) / len(loads)``. The member that would overflow it moves the
    rest of the group to the then least-loaded replica: a cut costs one more prefill of the
    shared blocks, an overfull replica keeps everyone waiting. So no replica ends with more
    than ``max(max(loads), fair share + max(costs))``.
    """
    if not loads:
        raise ValueError("assign_replicas needs at least one replica.")
    share = (sum(loads) + sum(costs)) / len(loads)
    groups: dict[tuple[int, ...] | int, list[int]] = defaultdict(list)
    for index, tokens in enumerate(prompts):
        key = tuple(tokens[:block_size]) if len(tokens) >= block_size else index
        groups[key].append(index)
    ordered = sorted(
        groups.values(), key=lambda members: (-sum(costs[i] for i in members), members[0])
    )
    replica_loads = list(loads)
    assignment = [-1] * len(prompts)
    for members in ordered:
        replica: int | None = None
        for index in sorted(members, key=lambda i: prompts[i]):
            if replica is None or replica_loads[replica] + costs[index] > share:
                replica = min(range(len(replica_loads)), key=replica_loads.__getitem__)
            replica_loads[replica] += costs[index]
            assignment[index] = replica
    return assignment


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """Where one replica runs: the cores it may use, and the environment it sets before
    anything initializes CUDA."""

    cpus: tuple[int, ...]
    environment: dict[str, str]


def place_replicas(
    num_replicas: int,
    tensor_parallel_size: int,
    cpus: Sequence[int],
    cuda_devices: Sequence[str] | None,
) -> list[ReplicaPlacement]:
    """Replica r gets the r-th of ``num_replicas`` equal slices of ``cpus`` (at least one
    core; with fewer cores than replicas they are shared round the list), and, on CUDA,
    devices ``r*tp .. r*tp+tp-1`` of ``cuda_devices`` as its ``CUDA_VISIBLE_DEVICES``.

    The replica's tensor-parallel ranks inherit both, so they split its cores among
    themselves and see its devices as cuda:0 .., and need not know they are a replica.
    """
    share = max(1, len(cpus) // num_replicas)
    tp = tensor_parallel_size
    return [
        ReplicaPlacement(
            cpus=tuple(cpus[(r * share + i) % len(cpus)] for i in range(share)),
            environment=(
                {}
                if cuda_devices is None
                else {"CUDA_VISIBLE_DEVICES": ",".join(cuda_devices[r * tp : (r + 1) * tp])}
            ),
        )
        for r in range(num_replicas)
    ]
