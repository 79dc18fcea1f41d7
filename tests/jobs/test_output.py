"""A job's output file: one writer at a time (the lock, a stale lock taken over), and
``--resume`` repairing what a crash or a race left."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paged_llm.cli import main
from tests.jobs.files import (
    lock_for,
    read_rows,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_second_writer_is_refused_while_the_lock_holder_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = lock_for(output, holder.pid)
        argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
        assert main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"{lock} is held by pid {holder.pid}" in err
        assert lock.read_text() == f"{holder.pid} {socket.gethostname()}\n"
        assert not output.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_and_every_lock_is_removed_at_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = write_jsonl(tmp_path / "out.jsonl", [{"id": 1, "outputs": []}])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = lock_for(output, dead.pid)
    argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"Took over the stale lock {lock}: its pid {dead.pid} is not running" in captured.err
    assert "Nothing to do" in captured.out
    assert not lock.exists()
    # An error after the lock is taken (here the model is missing) removes it too.
    write_jsonl(source, [{"id": 1, "prompt": "hi"}, {"id": 2, "prompt": "more"}])
    assert main([*argv, "--resume"]) == 1
    assert not lock.exists()


def test_resume_removes_duplicate_ids_keeping_the_first_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "hi"} for i in (1, 2)])
    first_of_1 = {"id": 1, "outputs": [{"text": "first"}]}
    first_of_2 = {"id": 2, "outputs": []}
    later = [{"id": 1, "outputs": [{"text": "again"}]}, {"id": 2, "error": "line 2: x"}]
    rows = [first_of_1, later[0], first_of_2, later[1], '{"id": 1, "ou']
    output = write_jsonl(tmp_path / "out.jsonl", rows)
    argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
    assert main([*argv, "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"Removed 2 duplicate row(s) from {output}" in captured.err
    assert "dropped a torn last line" in captured.err
    assert "Nothing to do" in captured.out
    assert read_rows(output) == [first_of_1, first_of_2]
    assert sorted(tmp_path.iterdir()) == [source, output]  # no temporary file left behind
