"""Child processes of the test process, to assert that none is left behind."""

from __future__ import annotations

import os
from multiprocessing import resource_tracker
from pathlib import Path


def child_pids() -> set[int]:
    """Every live or unreaped child process of this one, whoever started it, but for
    multiprocessing's resource tracker (started with the first spawned process, it serves
    them all and ends with this process)."""
    tracker = resource_tracker._resource_tracker._pid
    return {
        int(pid)
        for children in Path(f"/proc/{os.getpid()}/task").glob("*/children")
        for pid in children.read_text().split()
    } - {tracker}


def descendant_pids(pid: int | None = None) -> set[int]:
    """Every live process below ``pid`` (default: this one): children, their children, ..."""
    found: set[int] = set()
    stack = [os.getpid() if pid is None else pid]
    while stack:
        for children in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            try:
                below = {int(child) for child in children.read_text().split()}
            except FileNotFoundError:  # the process ended while we looked
                continue
            stack.extend(below - found)
            found |= below
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
