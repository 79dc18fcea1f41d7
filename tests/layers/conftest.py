"""Fixtures of the layer tests."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import csrc_cpu


@pytest.fixture
def cpu_kernels() -> None:
    """The C++ kernels, built: a test of them must not pass by falling back to torch."""
    assert csrc_cpu.load(), "the C++ kernel must build where the tests run"


@pytest.fixture
def failing_build(cpu_kernels: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh extension directory, a compiler that does not exist, and a `load` that has
    not run yet (the real one, loaded first, keeps its library for the other tests: a
    library loaded twice would register its operators twice)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(csrc_cpu, "load", functools.cache(csrc_cpu.load.__wrapped__))
