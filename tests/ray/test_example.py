"""examples/ray_dataset_generation.py runs to the end on the local two-node cluster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_examples import run_example

pytestmark = pytest.mark.slow


def test_ray_dataset_generation_answers_every_question_once(
    ray_address: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    out = run_example(
        "ray_dataset_generation.py",
        *("--address", ray_address, "--model", str(tiny_model_dir("llama"))),
        *("--num-rows", "6", "--max-tokens", "4", "--max-model-len", "128"),
        *("--concurrency", "1", "--batch-size", "3", "--workdir", str(tmp_path)),
    )
    assert "holds all 6 ids, each exactly once; 0 errors." in out
