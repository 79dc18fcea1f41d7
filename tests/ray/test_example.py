"""examples/ray_dataset_generation.py runs to the end on the local two-node cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_examples import run_example

pytestmark = pytest.mark.slow


def test_ray_dataset_generation_answers_every_question_once(
    ray_address: str, llama_dir: Path, tmp_path: Path
) -> None:
    out = run_example(
        "ray_dataset_generation.py",
        *("--address", ray_address, "--model", str(llama_dir)),
        *("--num-rows", "6", "--max-tokens", "4", "--max-model-len", "128"),
        *("--concurrency", "1", "--batch-size", "3", "--workdir", str(tmp_path)),
    )
    assert "holds all 6 ids, each exactly once; 0 errors." in out
