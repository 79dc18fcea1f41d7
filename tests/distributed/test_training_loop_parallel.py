"""The training-loop APIs over two real gloo ranks and two data-parallel replicas: a weight
update reaches every rank's shard and every replica (greedy tokens equal transformers with
the new weights), a bad one changes none, collective_rpc answers from each rank, and
sleep / wake_up go through every process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_llm import LLM
from paged_llm.engine.model_runner import ModelRunner
from tests.distributed.processes import child_pids
from tests.test_training_loop import SETTINGS, greedy, hf_tokens, perturbed

PARTIAL = (
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.norm.weight",
)


def rank_of(runner: ModelRunner) -> int:
    return runner.tp.rank


def _update_everywhere(model_dir: Path, **parallel: int) -> None:
    new_model = perturbed(model_dir)
    before_pids = child_pids()
    with LLM(model_dir, **SETTINGS, **parallel) as llm:
        before, _ = greedy(llm)
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape"):
            llm.update_weights(
                [*new_model.named_parameters(), ("model.norm.weight", torch.zeros(3))]
            )
        assert greedy(llm)[0] == before
        llm.update_weights(new_model.named_parameters())
        after, cached = greedy(llm)
        ranks = llm.collective_rpc(rank_of)
        llm.sleep(level=2)
        # Refused in the front: no rank or replica sees a request while asleep.
        with pytest.raises(RuntimeError, match=r"asleep \(kv_cache, weights"):
            greedy(llm)
        llm.wake_up()
        llm.update_weights(new_model.named_parameters())
        assert greedy(llm)[0] == after
        # Some tensors of a third model: a packed slice, a row-parallel projection, a norm.
        partial = {name: perturbed(model_dir, seed=2).state_dict()[name] for name in PARTIAL}
        llm.update_weights(partial)
        mixed, _ = greedy(llm)
    assert child_pids() - before_pids == set()
    assert cached == [0] * len(cached)
    assert after == hf_tokens(new_model)
    assert after != before
    new_model.load_state_dict(partial, strict=False)
    assert mixed == hf_tokens(new_model)
    assert mixed != after
    size = parallel.get("tensor_parallel_size", 1)
    assert ranks == list(range(size)) * parallel.get("data_parallel_size", 1)


def test_two_ranks_take_their_shards_of_an_update(llama_dir: Path) -> None:
    _update_everywhere(llama_dir, tensor_parallel_size=2)


@pytest.mark.slow
def test_two_replicas_take_the_same_update(llama_dir: Path) -> None:
    _update_everywhere(llama_dir, data_parallel_size=2)
