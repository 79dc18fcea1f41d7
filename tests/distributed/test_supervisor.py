"""The supervisor on its own, with children that end every way: a child's exception and
exit code reaching the parent, and stop's escalation from asking to killing, each death
named in words."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from paged_llm.distributed.supervisor import Child, Supervisor, wait

# A child starts in a few seconds (it imports paged_llm); far below a hang.
DEADLINE_S = 60.0


def _greet_then(how: str, commands: Connection, results: Connection) -> None:
    """A child: send ("hello", pid), then end as ``how`` says."""
    if how == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    results.send(("hello", os.getpid()))
    if how == "raise":
        raise ValueError("no device")
    if how == "exit":
        sys.exit(3)
    if how == "obey":
        while commands.recv()[0] != "stop":
            pass
        return
    while True:  # deaf to "stop" (and, with "ignore-sigterm", to SIGTERM)
        time.sleep(0.05)


class _Owner:
    """What owns a supervisor: an executor, a data-parallel engine."""

    def __init__(self, stop_timeout_s: float, terminate_timeout_s: float) -> None:
        self.supervisor = Supervisor(
            self, stop_timeout_s=stop_timeout_s, terminate_timeout_s=terminate_timeout_s
        )


def _start(owner: _Owner, *ways: str) -> list[Child]:
    """Children ending each of ``ways``, once each has said hello."""
    children = [owner.supervisor.spawn(_greet_then, (how,), name=f"test-{how}") for how in ways]
    waiting = list(children)
    deadline = time.monotonic() + DEADLINE_S
    while waiting:
        assert time.monotonic() < deadline
        for child in wait(waiting, timeout=1.0):
            if [kind for kind, _ in child.receive()] == ["hello"]:
                waiting.remove(child)
    return children


def test_a_child_s_exception_and_exit_code_reach_the_parent() -> None:
    owner = _Owner(stop_timeout_s=5.0, terminate_timeout_s=5.0)
    raised, exited = _start(owner, "raise", "exit")
    assert raised.reap(DEADLINE_S) == "exit code 1 after ValueError: no device"
    assert raised.failure is not None
    assert isinstance(raised.failure.exception, ValueError)
    assert "in _greet_then" in raised.failure.traceback
    assert exited.reap(DEADLINE_S) == "exit code 3"
    assert exited.failure is None
    # Each one's pipe read as end of file: nothing more comes from a child that ended.
    for child in (raised, exited):
        assert child.receive() == []
        assert child.ended
    owner.supervisor.stop()


def test_collecting_the_owner_asks_then_terminates_then_kills_its_children() -> None:
    owner = _Owner(stop_timeout_s=1.0, terminate_timeout_s=1.0)
    children = _start(owner, "obey", "deaf", "ignore-sigterm")
    started = time.monotonic()
    del owner
    gc.collect()
    # Each step waits its timeout at most once, for all the children together.
    assert time.monotonic() - started < 1.0 + 1.0 + 5.0
    assert [child.cause() for child in children] == [
        "exit code 0",
        "killed by signal SIGTERM",
        "killed by signal SIGKILL",
    ]
    assert all(child.ended and not child.send(("stop", None)) for child in children)
