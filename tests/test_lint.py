"""ruff and mypy, run as tests: CI runs only the test command, and STYLE.md asks that both
stay clean there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_finds_no_lint_or_formatting_issue() -> None:
    for args in (("ruff", "check", "."), ("ruff", "format", "--check", ".")):
        result = _run_module(*args)
        assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_mypy_finds_no_type_error() -> None:
    # NOTE: a bare `mypy` reads pyproject.toml's [tool.mypy] (which files, which overrides);
    # it caches in .mypy_cache, so only the first run analyzes torch and transformers (a minute).
    result = _run_module("mypy")
    assert result.returncode == 0, f"mypy:\n{result.stdout}{result.stderr}"
