"""The start-up's KV-cache checks on CPU come before anything sized by them: a
kv_cache_memory_bytes over the RAM there is, and a max_model_len (a model's huge
max_position_embeddings) whose one sequence the cache cannot hold, are ValueErrors that
name the setting and the figures, not an allocator's error after building a huge table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged_llm import LLM
from paged_llm.layers import rotary

# More rotary-table rows than the tiny llama's own max_position_embeddings (512) are a table
# sized by the huge override below.
MAX_TABLE_ROWS = 512
HUGE_MAX_POSITION = 2**30


@pytest.fixture
def table_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every rotary table the test builds; one over `MAX_TABLE_ROWS` fails the
    test before it is allocated."""
    sizes: list[int] = []
    build = rotary.compute_cos_sin_cache

    def recording(head_dim: int, max_position: int, *args: Any) -> torch.Tensor:
        sizes.append(max_position)
        assert max_position <= MAX_TABLE_ROWS, f"a rotary table of {max_position} rows was built"
        return build(head_dim, max_position, *args)

    monkeypatch.setattr(rotary, "compute_cos_sin_cache", recording)
    return sizes


@pytest.mark.usefixtures("one_thread")
def test_a_kv_cache_larger_than_the_ram_available_is_refused_naming_the_setting(
    llama_dir: Path, table_sizes: list[int]
) -> None:
    with pytest.raises(
        ValueError,
        match=r"kv_cache_memory_bytes=10000000000000 \(9313\.226 GiB\) is more than the "
        r"[0-9.]+ GiB of RAM available \(MemAvailable\) after loading the weights\. Lower "
        r"kv_cache_memory_bytes to at most [0-9]+",
    ):
        LLM(llama_dir, kv_cache_memory_bytes=10**13)
    assert table_sizes == []


@pytest.mark.usefixtures("one_thread")
def test_a_huge_max_position_embeddings_fails_the_kv_check_before_building_its_table(
    llama_dir: Path, table_sizes: list[int]
) -> None:
    # 512 bytes a token: 1 MiB holds 2048 tokens, not 2**30.
    with pytest.raises(
        ValueError,
        match=rf"cannot hold one sequence of max_model_len={HUGE_MAX_POSITION} tokens: that "
        r"needs 512\.000 GiB.*Raise kv_cache_memory_bytes, or lower max_model_len to at most "
        r"2048\.",
    ):
        LLM(
            llama_dir,
            hf_overrides={"max_position_embeddings": HUGE_MAX_POSITION},
            kv_cache_memory_bytes=2**20,
        )
    assert table_sizes == []


@pytest.mark.usefixtures("one_thread")
def test_the_rotary_table_is_built_by_the_first_step_at_max_model_len(
    llama_dir: Path, table_sizes: list[int]
) -> None:
    with LLM(llama_dir, max_model_len=64, kv_cache_memory_bytes=2**20) as llm:
        assert table_sizes == []
        llm.generate("hi", use_tqdm=False)
    assert table_sizes == [64]


def test_the_default_cache_holds_max_num_seqs_sequences_whose_length_is_no_multiple_of_a_block(
    llama_dir: Path,
) -> None:
    """The CPU default sizes the cache for max_num_seqs sequences of max_model_len tokens,
    in whole blocks: 308 tokens need 20 blocks of 16, not the 19 that 308 tokens' bytes
    make (which used to refuse to start)."""
    with LLM(llama_dir, max_model_len=308, max_num_seqs=1, block_size=16) as llm:
        assert llm.engine.block_manager.num_blocks == 20
