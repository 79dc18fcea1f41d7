"""Shared by the multi-process tests: the transformers references of the parity tests, and
the check that no test leaves a process behind."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator

import pytest

from tests.distributed.processes import child_pids
from tests.models.test_parity import references  # noqa: F401 - a fixture

# A child that was told to stop gets this long to be reaped.
_EXIT_GRACE_S = 10.0


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    before = child_pids()
    yield
    deadline = time.monotonic() + _EXIT_GRACE_S
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child_pids() - before == set()
    assert {process.pid for process in multiprocessing.active_children()} <= before
