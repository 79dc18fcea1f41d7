"""Every Python block of README.md runs, in order, as one script: the blocks as written, but
for their placeholder paths, which point at real models here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import smollm2_gguf_path, write_peft_adapter
from tests.jobs.files import cli_env

REPO_ROOT = Path(__file__).resolve().parents[1]
# README's placeholders, and what they stand for in this run.
PLACEHOLDERS = {
    '"path/to/model"': "LLAMA_DIR",
    '"model.gguf"': "SMOLLM2_GGUF",
    '"adapters/sql"': "SQL_ADAPTER",
    '"adapters/poet"': "POET_ADAPTER",
}


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.DOTALL)


def test_readme_has_python_blocks_and_names_only_known_placeholders() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 4
    paths = set(re.findall(r'LLM\(("[^"]+")', "\n".join(blocks)))
    assert paths <= {'"HuggingFaceTB/SmolLM2-135M-Instruct"', *PLACEHOLDERS}


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(llama_dir: Path, tmp_path: Path) -> None:
    script = "\n".join(readme_blocks())
    values = {"LLAMA_DIR": repr(str(llama_dir)), "SMOLLM2_GGUF": repr(str(smollm2_gguf_path()))}
    for seed, name in enumerate(["SQL_ADAPTER", "POET_ADAPTER"]):
        adapter = write_peft_adapter(
            llama_dir, tmp_path / name, rank=8, target_modules=["q_proj", "v_proj"], seed=seed
        )
        values[name] = repr(str(adapter))
    for placeholder, name in PLACEHOLDERS.items():
        script = script.replace(placeholder, values[name])
    # NOTE: run with -c: spawned data-parallel replicas then have no script to re-run.
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
