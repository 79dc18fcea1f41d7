"""Fixtures of the job tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs.files import write_lora_adapters


@pytest.fixture(scope="session")
def lora_adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama's `LORA_ADAPTERS`, by name: their folders."""
    return write_lora_adapters(llama_dir, tmp_path_factory.mktemp("lora-adapters"))
