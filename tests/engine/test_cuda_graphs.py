"""Decode batches padded into static buffers, as CUDA graphs replay them, run here eagerly
(capture=False) with the Triton kernels under the interpreter: padding rows must not
disturb the real ones, and every step's inputs must be read afresh from the static buffers
(the same tensor objects at every step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_llm import LLM, SamplingParams
from paged_llm.engine.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.slow)])
def test_padded_static_decode_batches_equal_the_plain_path(
    kv_cache_dtype: str, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [{"prompt_token_ids": [100 + i] * (3 + 7 * i)} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(
        llama_dir,
        max_model_len=128,
        max_num_seqs=8,
        attention_backend="triton",
        kv_cache_dtype=kv_cache_dtype,
    ) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.model_runner
        graphs = DecodeGraphs(runner.model, 8, 128, runner.block_size, runner.device, capture=False)
        decode_batch_sizes = []
        run = graphs.run
        monkeypatch.setattr(
            graphs, "run", lambda batch: decode_batch_sizes.append(batch.num_seqs) or run(batch)
        )
        runner.decode_graphs = graphs
        actual = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert actual == expected
    # Five sequences decode together, padded with three rows to the captured size 8.
    assert decode_batch_sizes and set(decode_batch_sizes) == {5}
    assert graphs.sizes == [1, 2, 4, 8]
