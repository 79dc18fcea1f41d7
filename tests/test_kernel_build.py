"""`csrc_cpu.load` beside other builds: a live one is waited for (a bounded time, saying
so), a killed one never blocks a later start, and a start that compiles says so."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import csrc_cpu

REPO_ROOT = Path(__file__).resolve().parent.parent
# torch's extension cache puts the build under $TORCH_EXTENSIONS_DIR/<name>, and takes
# the file `lock` there while ninja runs.
BUILD_DIR_NAME = "paged_llm_cpu"
TORCH_LOCK = "lock"

_LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import csrc_cpu
sys.exit(0 if csrc_cpu.load() else 1)
"""


def _run_load(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`load` in a fresh interpreter (a library built here must not be loaded twice into
    the test process); exit status 0 if it returned True."""
    return subprocess.run(
        [sys.executable, "-c", _LOAD],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def build_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh extension cache for this test; `load`'s wait cut to half a second."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(csrc_cpu, "BUILD_WAIT_SECONDS", 0.5)
    directory = tmp_path / BUILD_DIR_NAME
    directory.mkdir()
    return directory


@pytest.fixture
def foreign_build(build_dir: Path) -> Iterator[None]:
    """A live build that does not take paged_llm's flock (an older paged_llm, a killed
    build's compilers): a process at work in the directory, and torch's lock file."""
    (build_dir / TORCH_LOCK).touch()
    worker = subprocess.Popen(["sleep", "60"], cwd=build_dir)
    yield
    worker.kill()
    worker.wait()


def _load_expecting_the_fallback(caplog: pytest.LogCaptureFixture) -> tuple[bool, float]:
    """The uncached `load` (the cached one may have run in this process), expecting the
    fallback warning; its result and how long it took."""
    start = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="paged_llm.csrc_cpu"),
        pytest.warns(RuntimeWarning, match="still being built by another process after"),
    ):
        loaded = csrc_cpu.load.__wrapped__()
    return loaded, time.monotonic() - start


def test_a_start_waits_a_bounded_time_for_a_live_build_then_runs_on_torch(
    build_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A separate open file: its flock conflicts with load's even within this process, as
    # another live process's would.
    with open(build_dir / csrc_cpu.BUILD_LOCK_FILE, "a") as other_builder:
        fcntl.flock(other_builder, fcntl.LOCK_EX)
        loaded, elapsed = _load_expecting_the_fallback(caplog)
    assert loaded is False
    assert elapsed < 10
    assert f"waiting for another process building the CPU kernels: {build_dir}" in caplog.text


@pytest.mark.usefixtures("foreign_build")
def test_a_live_build_without_the_flock_keeps_its_lock_file(
    build_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded, elapsed = _load_expecting_the_fallback(caplog)
    assert loaded is False
    assert elapsed < 10
    assert "waiting for another process building the CPU kernels" in caplog.text
    assert (build_dir / TORCH_LOCK).exists()


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path: Path) -> None:
    """torch's lock file, older than a live build's could be, and nothing at work in the
    directory: the start builds (here with no compiler: it fails fast, and says so)."""
    torch_lock = tmp_path / BUILD_DIR_NAME / TORCH_LOCK
    torch_lock.parent.mkdir()
    torch_lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(torch_lock, (an_hour_ago, an_hour_ago))
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
        "CXX": str(tmp_path / "no-such-compiler"),
    }
    completed = _run_load(env, timeout=120)
    assert completed.returncode == 1
    assert "could not be built" in completed.stderr
    assert not torch_lock.exists()


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [True, False], ids=["with-compilers", "python-only"])
def test_a_build_killed_midway_does_not_block_the_next_start(
    whole_group: bool, tmp_path: Path
) -> None:
    """A build killed with SIGKILL leaves torch's lock file behind. With its compilers (a
    pre-emption), the next start rebuilds, saying so; the Python process alone (an OOM
    kill), the compilers it started finish the build while the next start waits."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    torch_lock = tmp_path / BUILD_DIR_NAME / TORCH_LOCK
    killed = subprocess.Popen(
        [sys.executable, "-c", _LOAD],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not torch_lock.exists() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert torch_lock.exists(), "the first build never took torch's lock"
    finally:
        if whole_group:
            os.killpg(killed.pid, signal.SIGKILL)
        else:
            killed.kill()
        killed.wait()
    assert torch_lock.exists()
    completed = _run_load(env, timeout=400)
    assert completed.returncode == 0, completed.stderr[-2000:]
    if whole_group:
        assert "building paged_llm's CPU kernels (once per machine, ~30 s) into" in completed.stderr
        assert "built paged_llm's CPU kernels in" in completed.stderr
    else:
        assert "waiting for another process building the CPU kernels" in completed.stderr
