"""The assignment of requests to data-parallel replicas, and of replicas to cores and
devices: pure functions, tested without a process."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from paged_llm.frontend.replica_assignment import assign_replicas, place_replicas, request_cost
from paged_llm.sampling_params import SamplingParams


def loads_of(assignment: list[int], costs: list[int], loads: list[int]) -> list[int]:
    totals = list(loads)
    for replica, cost in zip(assignment, costs, strict=True):
        totals[replica] += cost
    return totals


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            # A tiny alphabet and block size, so that prompts often share a first block.
            st.lists(st.integers(0, 2), min_size=1, max_size=6),
            st.integers(1, 50),
        ),
        max_size=40,
    ),
    loads=st.lists(st.integers(0, 60), min_size=1, max_size=4),
)
def test_every_request_is_assigned_once_and_no_replica_exceeds_its_share_by_more_than_one_request(
    requests: list[tuple[list[int], int]], loads: list[int]
) -> None:
    prompts = [prompt for prompt, _ in requests]
    costs = [cost for _, cost in requests]
    assignment = assign_replicas(prompts, costs, loads, block_size=2)
    assert len(assignment) == len(prompts)
    assert all(0 <= replica < len(loads) for replica in assignment)
    share = (sum(loads) + sum(costs)) / len(loads)
    bound = max([*loads, share + max(costs, default=0)])
    assert max(loads_of(assignment, costs, loads)) <= bound


def test_prefix_groups_that_fit_stay_on_one_replica() -> None:
    # Two groups of five prompts sharing their first block (of 4 tokens), and equal costs.
    prompts = [[7, 7, 7, 7, i] for i in range(5)] + [[9, 9, 9, 9, i] for i in range(5)]
    assignment = assign_replicas(prompts, [10] * 10, [0, 0], block_size=4)
    assert len(set(assignment[:5])) == len(set(assignment[5:])) == 1
    assert assignment[0] != assignment[5]


def test_a_group_too_big_for_one_replica_is_cut_where_prompts_diverge_first() -> None:
    # Every prompt shares the first block (a chat header, say); within it, two subgroups
    # share more. Token order keeps each subgroup together when the group is cut in two.
    header = [1, 2, 3, 4]
    prompts = [[*header, subgroup, subgroup, i] for subgroup in (5, 6) for i in range(4)]
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # interleaved, as a dataset might list them
    assignment = assign_replicas([prompts[i] for i in order], [10] * 8, [0, 0], block_size=4)
    by_prompt = {order[position]: replica for position, replica in enumerate(assignment)}
    assert len({by_prompt[i] for i in range(4)}) == len({by_prompt[i] for i in range(4, 8)}) == 1
    assert by_prompt[0] != by_prompt[4]


def test_balance_by_cost_not_by_count() -> None:
    # Round robin would put both long requests on replica 0.
    costs = [100, 10, 100, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    prompts = [[i] for i in range(len(costs))]  # shorter than a block: no groups
    assignment = assign_replicas(prompts, costs, [0, 0], block_size=16)
    assert loads_of(assignment, costs, [0, 0]) == [150, 150]
    # Work already running counts: the idle replica takes what is new.
    assert assign_replicas([[1], [2], [3]], [10, 10, 10], [100, 0], block_size=16) == [1, 1, 1]


def test_request_cost_counts_the_prompt_and_every_sequence() -> None:
    assert request_cost(30, SamplingParams(n=3, max_tokens=10), max_model_len=256) == 60
    assert request_cost(30, SamplingParams(max_tokens=None), max_model_len=256) == 256


def test_each_replica_gets_its_own_cores_and_tensor_parallel_devices() -> None:
    placements = place_replicas(2, 2, cpus=[0, 1, 2, 3, 4], cuda_devices=["4", "5", "6", "7"])
    assert [p.cpus for p in placements] == [(0, 1), (2, 3)]
    assert [p.environment for p in placements] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    # More replicas than cores: one core each, shared; nothing to set on CPU.
    placements = place_replicas(3, 1, cpus=[0, 1], cuda_devices=None)
    assert [p.cpus for p in placements] == [(0,), (1,), (0,)]
    assert all(p.environment == {} for p in placements)
