"""A script that starts workers or replicas at its top level, without the main guard: spawn
re-runs that top level in every child, and the parent says so instead of "exit code 1"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.processes import session_pids

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
from paged_llm import LLM, SamplingParams

{guard}llm = LLM({model!r}, max_model_len=128, {setting}=2)
{indent}outputs = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
{indent}print("generated", len(outputs[0].outputs[0].token_ids))
"""


def _run_script(
    tmp_path: Path, model: str, setting: str, guarded: bool
) -> subprocess.CompletedProcess[str]:
    """Run the script in a session of its own; assert that nothing of it outlives it."""
    script = tmp_path / "generate.py"
    guard = 'if __name__ == "__main__":\n    ' if guarded else ""
    indent = "    " if guarded else ""
    script.write_text(SCRIPT.format(guard=guard, indent=indent, model=model, setting=setting))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stdout, stderr = process.communicate(timeout=300)
    # Orphans keep the script's session; they get a moment to finish exiting.
    deadline = time.monotonic() + 10
    while session_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_pids(process.pid) == set(), stderr
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize(
    ("setting", "children"),
    [("tensor_parallel_size", "worker"), ("data_parallel_size", "replica")],
)
def test_a_script_without_the_main_guard_is_told_to_add_it(
    tmp_path: Path, model: str, setting: str, children: str
) -> None:
    result = _run_script(tmp_path, model, setting, guarded=False)
    assert result.returncode != 0
    assert (
        f"UnguardedScriptError: {setting}=2 starts {children} processes with spawn, which "
        "re-runs your script's top level: put the code that builds the LLM under "
        '`if __name__ == "__main__":`.'
    ) in result.stderr
    assert "generated" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["tensor_parallel_size", "data_parallel_size"])
def test_a_script_with_the_main_guard_generates(tmp_path: Path, model: str, setting: str) -> None:
    result = _run_script(tmp_path, model, setting, guarded=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "generated 3"
