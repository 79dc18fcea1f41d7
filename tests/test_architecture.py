"""The architecture as the code must keep it (docs/architecture.md): imports point down the
layers, no two modules import each other (type-only and function-level imports count), and
no module outgrows one responsibility's size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600


def test_imports_follow_the_layering_contract_and_have_no_cycle() -> None:
    # NOTE: the contracts live in pyproject.toml ([tool.importlinter]): the layers from the
    # entry points down to the kernels (so the engine never imports the front end, layers and
    # models never import the engine, Ray and the integrations never import the CLI), and no
    # cycle between the modules of any package.
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_is_over_600_lines() -> None:
    sizes = {
        path.relative_to(REPO_ROOT): len(path.read_text().splitlines())
        for path in (REPO_ROOT / "paged_llm").rglob("*.py")
    }
    assert {path: size for path, size in sizes.items() if size > MAX_MODULE_LINES} == {}
