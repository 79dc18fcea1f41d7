"""A job's output file: one JSON line per finished request, appended and fsynced at once,
so a crash loses only the requests still running; repaired and skipped on ``--resume``;
written by one job at a time.

One writer per output: a job holds ``<output>.lock`` (created with O_CREAT|O_EXCL, holding
``pid host``) for its whole run and removes it at exit. A second job on the same output is
refused while the holder lives; a lock whose pid is dead on this host is stale and taken
over, with a note on stderr.

Output rows are UTF-8; a record that cannot be (an id with a lone surrogate) is written with
ASCII escapes, so the file stays valid and ``--resume`` reads the same id back.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from paged_llm.jobs.rows import JobError, decode_line, parse_json

# NOTE: every output row begins with these bytes (`json_line` with each job's records, which
# put "id" first); `recover_output` takes a last line for a torn row only if it starts so.
ROW_START = b'{"id": '


def json_line(record: dict[str, Any]) -> bytes:
    """One output row as a UTF-8 JSON line."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:  # an id with a lone surrogate: escapes keep it exact
        return (json.dumps(record) + "\n").encode()


class RowWriter(Protocol):
    """Where a job puts its output rows: a file here, a Ray Data block on a cluster."""

    def write(
        self,
        record: dict[str, Any],
        *,
        error: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None: ...


@dataclass
class RowCounts:
    """What a job wrote, for its summary line."""

    num_written: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, *, error: bool, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.num_written += 1
        self.num_errors += error
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def merge(self, other: RowCounts) -> None:
        """Add the counts of another part of the job."""
        for count in fields(self):
            setattr(self, count.name, getattr(self, count.name) + getattr(other, count.name))

    def summary(
        self,
        output: Path,
        num_skipped: int,
        seconds: float,
        *,
        loading_included: bool = False,
        pooled: bool = False,
    ) -> str:
        """The job's last line; ``seconds`` is the time spent generating, so that the output
        tokens per second leave out loading the model, unless ``loading_included`` says the
        figure could not separate them (a cluster's actors load while others generate). A
        ``pooled`` job (embed, classify) generates nothing: its rate is prompt tokens per
        second."""
        timed = f"{seconds:.1f} s" + (
            ", the actors' model loading included" if loading_included else ""
        )
        done = (
            f"Done: {self.num_written} rows written to {output} ({self.num_errors} errors), "
            f"{num_skipped} skipped as already done; "
        )
        if pooled:
            return (
                f"{done}{self.prompt_tokens} prompt tokens in {timed} "
                f"({self.prompt_tokens / seconds:.1f} prompt tok/s)."
            )
        return (
            f"{done}{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens in "
            f"{timed} ({self.completion_tokens / seconds:.1f} output tok/s)."
        )


class OutputWriter:
    """Appends output rows, each flushed and fsynced at once so a crash loses none already
    written, and counts what it wrote for the summary."""

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self.counts = RowCounts()

    def write(
        self,
        record: dict[str, Any],
        *,
        error: bool,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self._sink.write(json_line(record))
        self._sink.flush()
        os.fsync(self._sink.fileno())
        self.counts.add(
            error=error, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
        )


def recover_output(path: Path) -> set[str | int]:
    """The ids already in an output file, after cutting away a torn last row and removing
    rows whose id an earlier row already has.

    Only what our own writer can leave behind is repaired: every complete line must be an
    output row (a JSON object with a string or integer ``id``), and the bytes after the last
    newline, if any, must be the start of one (a write cut short by a crash), which is
    truncated away so that its request runs again. Anything else means the file is not a
    job's output (or was edited): JobError names the file and the line, and no byte is
    changed. Duplicates (from writers that raced before the output lock existed) keep the
    first row of each id; the file is then rewritten through a temporary file and
    os.replace, so a crash leaves either the old or the new one.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    # NOTE: split at newlines only, so line numbers are an editor's whatever else a line holds.
    lines = [line + b"\n" for line in data[:keep].split(b"\n")[:-1]]
    ids: set[str | int] = set()
    unique: list[bytes] = []
    num_duplicates = 0
    for number, line in enumerate(lines, start=1):
        try:
            row_id = _row_id(line)
        except ValueError as error:
            raise JobError(
                f"{path}:{number}: not an output row of paged-llm ({error}): {_shown(line)}. "
                f"{_NOT_OURS}"
            ) from None
        if row_id in ids:
            num_duplicates += 1
            continue
        ids.add(row_id)
        unique.append(line)
    torn = data[keep:]
    if torn and not (torn.startswith(ROW_START) or ROW_START.startswith(torn)):
        raise JobError(
            f"{path}:{len(lines) + 1}: not an output row of paged-llm, nor the start of one cut "
            f"short by a crash (its rows begin with {ROW_START.decode()!r}): {_shown(torn)}. "
            f"{_NOT_OURS}"
        )
    if num_duplicates:
        # The rewrite also leaves out a torn last line.
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as sink:
            sink.writelines(unique)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temporary, path)
        print(
            f"Removed {num_duplicates} duplicate row(s) from {path}, keeping the first row of "
            "each id.",
            file=sys.stderr,
        )
    elif torn:
        with open(path, "r+b") as sink:
            sink.truncate(keep)
    if torn:
        print(f"Repaired {path}: dropped a torn last line ({len(torn)} bytes).", file=sys.stderr)
    return ids


_NOT_OURS = (
    "--resume continues only a file this command wrote, and this one was left untouched: "
    "check that --output names the right file, or fix or remove that line."
)


def _row_id(line: bytes) -> str | int:
    """The id of a complete output line; ValueError says why the line is not an output row."""
    record = parse_json(decode_line(line))
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    row_id = record.get("id")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"its 'id' must be a string or an integer, got {type(row_id).__name__}")
    return row_id


def _shown(line: bytes) -> str:
    """The start of a line, as it reads, for an error message."""
    text = line.decode(errors="replace").rstrip("\n")
    return repr(text if len(text) <= 60 else text[:60] + "...")


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold ``<output>.lock`` while the body runs, so that one job at a time writes output.

    The lock file is created atomically (O_CREAT|O_EXCL) and holds ``pid host``. A lock whose
    holder is alive, or on another host where it cannot be checked, raises JobError naming the
    file and the pid; one whose pid is dead on this host (its holder was killed before it could
    remove it) is taken over, with a note on stderr; a symbolic link in its place raises
    JobError. The lock is removed when the body ends, by an error or Ctrl-C too.
    """
    lock = output.with_name(output.name + ".lock")
    host = socket.gethostname()
    mine = f"{os.getpid()} {host}\n"
    while True:
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            pass
        # NOTE: O_EXCL never follows a link, but reading would: a link is no lock of ours.
        if lock.is_symlink():
            raise JobError(
                f"{lock} is a symbolic link, not a lock file of paged-llm (it was left as it "
                "is); remove it if no job is running on this output."
            )
        try:
            held = lock.read_text()
        except FileNotFoundError:  # its holder just removed it
            continue
        pid, _, holder_host = held.strip().partition(" ")
        if not _lock_is_stale(pid, holder_host, host):
            raise JobError(
                f"{output} is being written by another paged-llm: {lock} is held by pid "
                f"{pid or '?'} on {holder_host or '?'}. Wait for it to finish or stop it; if it "
                f"is not running, delete {lock}."
            )
        # NOTE: read again just before unlinking, so that a lock another process has taken
        # over since is left alone; if it has, the next O_EXCL fails and names that process.
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == held:
                lock.unlink()
                print(
                    f"Took over the stale lock {lock}: its pid {pid} is not running on {host}.",
                    file=sys.stderr,
                )
    try:
        os.write(descriptor, mine.encode())
    finally:
        os.close(descriptor)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == mine:
                lock.unlink()


def _lock_is_stale(pid: str, holder_host: str, host: str) -> bool:
    if holder_host != host or not pid.isdigit() or int(pid) == 0:
        return False
    # NOTE: our own pid in a lock we have not taken yet is a previous run's, e.g. a container
    # restarted with the same pid and host name.
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
