"""Pooling on Ray Data: `ProcessorConfig(task="embed")` (and ``"classify"``) adds each row's
vector as the ``embedding`` (``probs``) column, the vectors `LLM.embed` gives in this
process, and bad rows an ``error``, on the local two-node cluster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray.data

from paged_llm import LLM
from paged_llm.pooling_params import PoolingParams
from paged_llm.ray import ProcessorConfig, build_processor

ENGINE_KWARGS = {"max_model_len": 64}
TEXTS = [f"Sentence number {i} about {'cats ' * (i % 4)}" for i in range(8)]


def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] == 8:
        return {"prompt": "word " * 100}  # over max_model_len
    if row["id"] == 9:
        return {"prompt": "fine", "pooling_params": {"dimensions": 0}}
    return {"prompt": row["text"], "pooling_params": {"dimensions": row["dimensions"]}}


@pytest.mark.slow
def test_embed_task_adds_each_rows_embedding_and_errors(
    ray_address: str, model: str, one_thread: None
) -> None:
    items = [
        {"id": i, "text": text, "dimensions": 16 if i % 2 else None} for i, text in enumerate(TEXTS)
    ]
    items += [{"id": 8, "text": "", "dimensions": None}, {"id": 9, "text": "", "dimensions": None}]
    config = ProcessorConfig(model, ENGINE_KWARGS, concurrency=2, batch_size=5, task="embed")
    processor = build_processor(
        config,
        preprocess=preprocess,
        postprocess=lambda row: {
            "id": row["id"],
            "embedding": row["embedding"],
            "num_prompt_tokens": row["num_prompt_tokens"],
            "error": row["error"],
        },
    )
    rows = sorted(processor(ray.data.from_items(items)).take_all(), key=lambda row: row["id"])
    assert [row["id"] for row in rows] == list(range(10))

    with LLM(model, runner="pooling", **ENGINE_KWARGS) as llm:
        expected = llm.embed(
            TEXTS, [PoolingParams(dimensions=16 if i % 2 else None) for i in range(8)]
        )
    for row, output in zip(rows[:8], expected, strict=True):
        assert row["error"] is None and row["num_prompt_tokens"] > 0
        np.testing.assert_allclose(row["embedding"], output.outputs.embedding, atol=1e-5)
    assert "max_model_len" in rows[8]["error"] and rows[8]["embedding"] is None
    assert rows[9]["error"].startswith("PoolingParams.dimensions must be an int >= 1")


@pytest.mark.slow
def test_classify_task_adds_probs(
    ray_address: str, tiny_classifier_dir: Callable[[str, int], Path], one_thread: None
) -> None:
    classifier = str(tiny_classifier_dir("llama", 2))
    config = ProcessorConfig(classifier, ENGINE_KWARGS, task="classify")
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"]})
    rows = processor(ray.data.from_items([{"text": text} for text in TEXTS[:3]])).take_all()
    assert all(row["error"] is None for row in rows)
    assert all(sum(row["probs"]) == pytest.approx(1.0, abs=1e-5) for row in rows)


def test_a_pooling_task_refuses_a_generating_runner() -> None:
    with pytest.raises(ValueError, match="runs a pooling model, and engine_kwargs has runner"):
        ProcessorConfig("model", {"runner": "generate"}, task="embed")
    with pytest.raises(ValueError, match=r"ProcessorConfig\.task must be"):
        ProcessorConfig("model", task="score")
