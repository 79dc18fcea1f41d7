"""A job's output file: one writer at a time (the lock, a stale lock taken over), and
``--resume`` repairing what a crash or a race left and refusing any other file, a symlinked
output followed to its file."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paged_llm.cli import main
from paged_llm.jobs import openai_batch
from paged_llm.jobs.output import json_line, recover_output
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


NOT_OURS = {
    "a line of prose": (b"my notes, no newline", 1),
    "prose lines": (b"first thought\nsecond thought\n", 1),
    "a CSV whose last line has no newline": (b"id,prompt\n1,hello", 1),
    "JSON lines without an id": (b'{"prompt": "a"}\n{"prompt": "b"}\n', 1),
    "a row whose id is not a string or an integer": (b'{"id": 1.5, "outputs": []}\n', 1),
    "rows, then a line of prose": (b'{"id": 1, "outputs": []}\nthe end', 2),
    "rows, then a JSON line without an id": (b'{"id": 1, "outputs": []}\n{"x": 1}\n', 2),
    "rows around a blank line": (b'{"id": 1, "outputs": []}\n\n{"id": 2, "outputs": []}\n', 2),
}


@pytest.mark.parametrize("kind", sorted(NOT_OURS))
def test_resume_refuses_a_file_that_is_not_a_job_output_and_changes_no_byte(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    content, bad_line = NOT_OURS[kind]
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "hi"} for i in (1, 2)])
    output = tmp_path / "out.jsonl"
    output.write_bytes(content)
    argv = ["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{output}:{bad_line}: not an output row of paged-llm" in err
    assert "check that --output names the right file" in err
    assert output.read_bytes() == content
    assert sorted(tmp_path.iterdir()) == [source, output]


def test_resume_repairs_every_torn_write_of_either_job_kind(tmp_path: Path) -> None:
    """Whatever prefix of a row a crash leaves after the rows before it (none included, as a
    crash during the first write leaves), resuming keeps exactly the complete rows."""
    request = openai_batch.parse_line(3, b'{"custom_id": "q", "url": "/v1/completions"}', {})
    assert request.error is not None
    rows = [
        json_line({"id": "r1", "outputs": [{"index": 0, "text": "déjà vu 🙂"}]}),
        json_line({"id": 7, "error": "line 2: the prompt is empty"}),
        json_line(openai_batch.error_line(request, request.error)),
    ]
    output = tmp_path / "out.jsonl"
    for num_complete in range(len(rows)):
        complete = b"".join(rows[:num_complete])
        torn = rows[num_complete]
        for cut in range(len(torn)):
            output.write_bytes(complete + torn[:cut])
            ids = recover_output(output)
            assert output.read_bytes() == complete, (num_complete, cut)
            assert len(ids) == num_complete


def test_a_symlinked_output_is_followed_to_its_file_for_the_lock_and_the_repair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    (tmp_path / "runs").mkdir()
    target = write_jsonl(tmp_path / "runs" / "3.jsonl", [{"id": 1, "outputs": []}] * 2)
    link = tmp_path / "latest.jsonl"
    link.symlink_to(Path("runs") / "3.jsonl")
    argv = ["generate", "-i", str(source), "-o", str(link), "-m", "missing/model", "--resume"]
    # A job on the file itself holds the lock beside it: a job on the link is refused.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = lock_for(target, holder.pid)
        assert main(argv) == 2
        assert f"{lock} is held by pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    lock.unlink()
    # The duplicate is removed from the file, which replaces the file and keeps the link.
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"Removed 1 duplicate row(s) from {target}" in captured.err
    assert "Nothing to do" in captured.out
    assert link.is_symlink() and link.resolve() == target
    assert read_rows(target) == [{"id": 1, "outputs": []}]
    assert sorted(tmp_path.rglob("*")) == [source, link, target.parent, target]


def test_a_symlink_in_place_of_the_lock_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    output = tmp_path / "out.jsonl"
    precious = tmp_path / "precious.txt"
    precious.write_text("12 words of mine\n")
    lock = tmp_path / "out.jsonl.lock"
    lock.symlink_to(precious)
    assert main(["generate", "-i", str(source), "-o", str(output), "-m", "missing/model"]) == 2
    assert f"{lock} is a symbolic link, not a lock file of paged-llm" in capsys.readouterr().err
    assert lock.is_symlink() and precious.read_text() == "12 words of mine\n"
    assert not output.exists()
