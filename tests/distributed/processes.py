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
