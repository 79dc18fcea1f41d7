"""LoRA adapters over two real gloo ranks and over two data-parallel replicas: greedy tokens
equal transformers + peft. Each rank cuts its shard of every adapter (column-parallel B
rows, row-parallel A columns, a replicated KV head's rows on both ranks) and each replica
reads the adapters from their paths itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from paged_llm import LLM
from tests.distributed.processes import child_pids
from tests.test_lora import adapters, as_inputs, expected_tokens, greedy, token_prompts

__all__ = ["adapters"]  # the fixture, for this module's tests


def _mixed_run(model_dir: Path, loras: list, **settings: object) -> None:
    assigned = [[*loras, None][i % (len(loras) + 1)] for i in range(8)]
    prompts = token_prompts(8, seed=5, lengths=(30, 7, 45, 12))
    before = child_pids()
    with LLM(
        model_dir,
        max_model_len=64,
        max_num_batched_tokens=16,
        enable_lora=True,
        max_loras=2,
        **settings,
    ) as llm:
        outputs = llm.generate(as_inputs(prompts), greedy(), use_tqdm=False, lora_request=assigned)
    assert child_pids() - before == set()
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens(
        model_dir, prompts, assigned, 8
    )


@pytest.mark.parametrize("arch", ["llama", pytest.param("mistral-1kv", marks=pytest.mark.slow)])
def test_adapters_on_two_ranks_equal_peft(
    arch: str, tiny_model_dir: Callable[[str], Path], adapters: Callable
) -> None:
    _mixed_run(tiny_model_dir(arch), adapters(arch), tensor_parallel_size=2)


@pytest.mark.slow
def test_adapters_on_two_replicas_equal_peft(llama_dir: Path, adapters: Callable) -> None:
    _mixed_run(llama_dir, adapters("llama"), data_parallel_size=2)
