"""Child processes, started, watched and stopped one way: tensor-parallel workers and
data-parallel replicas alike.

A child is started with ``spawn`` (it inherits nothing but what is pickled for it) and talks
to its parent over two one-way pipes of ``(kind, payload)`` messages, commands down and
results up. The parent closes the child's ends, so a child that dies reads as end of file;
it watches many children at once on their result pipes and process sentinels (`wait`).
Two kinds belong to the supervisor; every other kind is its user's protocol::

    parent -> child   ("stop", None)             finish and return from the target
    child -> parent   ("failed", ChildFailure)   the target raised; sent before exit code 1

``spawn`` runs the parent's script again in each child, as module ``__mp_main__``, before
the target; a script that starts children at its top level, outside ``if __name__ ==
"__main__":``, would start them again there. Such a child exits with a code of its own
instead (`Child.reran_script`), for its parent to raise `UnguardedScriptError`.

A child ignores Ctrl-C (it reaches the whole process group; the parent decides how its
children stop); its target returns when its command pipe closes (the parent is gone), so
no child outlives its parent for long. A `Supervisor` stops its children when its owner is
shut down, collected, or at interpreter exit: asked with "stop", then terminated, then
killed.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context
from multiprocessing.process import BaseProcess
from typing import Any

Message = tuple[str, Any]

_CONTEXT = get_context("spawn")

# The exit code of a child whose re-run of its parent's script reached `Supervisor.spawn`
# (sysexits' EX_CONFIG: a setup error, which no target of ours exits with).
_SCRIPT_RERUN_EXIT_CODE = 78


class UnguardedScriptError(RuntimeError):
    """The children re-ran the user's script, whose top level starts children of its own:
    the script lacks ``if __name__ == "__main__":``."""

    def __init__(self, setting: str, children: str) -> None:
        super().__init__(
            f"{setting} starts {children} processes with spawn, which re-runs your script's "
            'top level: put the code that builds the LLM under `if __name__ == "__main__":`.'
        )


@dataclass(frozen=True, slots=True)
class ChildFailure:
    """Why a child process gave up: its traceback, and the exception itself when it pickles
    (so a start-up ValueError reaches the user as the ValueError it is)."""

    traceback: str
    exception: BaseException | None

    @property
    def summary(self) -> str:
        """The traceback's last line, e.g. ``ValueError: ...``."""
        return self.traceback.strip().splitlines()[-1]


@dataclass(eq=False)
class Child:
    """The parent's view of one child process: the process and the parent's pipe ends."""

    process: BaseProcess
    commands: connection.Connection  # parent -> child
    results: connection.Connection  # child -> parent
    failure: ChildFailure | None = None  # what the child reported before it exited
    ended: bool = False  # it has ended (or is ending): nothing more will come from it

    def send(self, message: Message) -> bool:
        """Send ``message``; False when the child's pipe is closed (it ended, or is ending)."""
        return self._deliver(lambda: self.commands.send(message))

    def send_pickled(self, message: bytes) -> bool:
        """`send` of a message pickled once for many children."""
        return self._deliver(lambda: self.commands.send_bytes(message))

    def _deliver(self, send: Callable[[], None]) -> bool:
        try:
            send()
        except OSError:
            return False
        return True

    def receive(self) -> list[Message]:
        """The messages the child has sent, without blocking. A failure report goes to
        `failure` instead; end of file, or a process that ended, sets `ended`."""
        # NOTE: liveness before reading: what a process sent before it ended is in the pipe.
        gone = not self.process.is_alive()
        messages: list[Message] = []
        try:
            while self.results.poll():  # end of file polls readable, then raises EOFError
                kind, payload = self.results.recv()
                if kind == "failed":
                    self.failure = payload
                else:
                    messages.append((kind, payload))
        except (EOFError, OSError):
            gone = True
        self.ended = self.ended or gone
        return messages

    def reap(self, timeout: float) -> str:
        """Wait up to ``timeout`` s for the child to end, kill it if it lingers (it broke its
        pipe or a collective: it is of no more use), and say why it ended (`cause`). What
        it sent and nobody read is dropped, but for its failure report."""
        self.process.join(timeout)
        self.receive()
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.ended = True
        return self.cause()

    @property
    def reran_script(self) -> bool:
        """The child ended while re-running its parent's script, which lacks the main guard
        (known once it is reaped)."""
        return self.process.exitcode == _SCRIPT_RERUN_EXIT_CODE

    def cause(self) -> str:
        """Why the process ended, in words: ``exit code 1``, ``killed by signal SIGKILL``,
        followed by ``after ValueError: ...`` when it reported an exception."""
        code = self.process.exitcode
        if code is None:
            how = "still running"
        elif code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return how if self.failure is None else f"{how} after {self.failure.summary}"


def wait(children: Sequence[Child], timeout: float | None = None) -> list[Child]:
    """Block until one of ``children`` has sent something or ended, or ``timeout`` s pass;
    the children that have (none after a timeout), to `Child.receive` from."""
    by_handle: dict[Any, Child] = {}
    for child in children:
        by_handle[child.results] = by_handle[child.process.sentinel] = child
    ready = {by_handle[handle] for handle in connection.wait(list(by_handle), timeout)}
    return [child for child in children if child in ready]


class Supervisor:
    """The child processes of one owner (an executor, a data-parallel engine).

    They end with the owner: `stop`, the owner's collection, or interpreter exit asks each
    to stop, waits ``stop_timeout_s``, terminates those still running, waits
    ``terminate_timeout_s``, kills the rest, and joins them all.
    """

    def __init__(self, owner: object, *, stop_timeout_s: float, terminate_timeout_s: float):
        self.children: list[Child] = []
        # NOTE: the finalizer holds the list, not the owner, and sees children added later.
        self._finalizer = weakref.finalize(
            owner, _stop, self.children, stop_timeout_s, terminate_timeout_s
        )

    def spawn(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        *,
        name: str,
        daemon: bool = False,
    ) -> Child:
        """Start ``target(*args, commands, results)`` in a new process named ``name``.

        ``target`` and ``args`` are pickled (a module-level function). An exception that
        escapes ``target`` reaches the parent as the child's `failure`. ``daemon`` lets
        multiprocessing end the child at exit too; a child that starts processes of its own
        cannot be one.
        """
        # NOTE: multiprocessing marks a child "inheriting" while it re-runs its parent's
        # script; starting a process then raises its bootstrapping error, which the parent
        # would see only as exit code 1.
        if getattr(_CONTEXT.current_process(), "_inheriting", False):
            raise SystemExit(_SCRIPT_RERUN_EXIT_CODE)
        child_commands, commands = _CONTEXT.Pipe(duplex=False)
        results, child_results = _CONTEXT.Pipe(duplex=False)
        process = _CONTEXT.Process(
            target=_child_main,
            args=(target, args, child_commands, child_results),
            name=name,
            daemon=daemon,
        )
        try:
            process.start()
        except BaseException:
            commands.close()
            results.close()
            raise
        finally:
            # NOTE: the child's ends close here, so a dead child reads as end of file.
            child_commands.close()
            child_results.close()
        child = Child(process, commands, results)
        self.children.append(child)
        return child

    def stop(self) -> None:
        """End every child now (once; later calls do nothing)."""
        self._finalizer()


def _stop(children: list[Child], stop_timeout_s: float, terminate_timeout_s: float) -> None:
    for child in children:
        if child.process.is_alive():
            child.send(("stop", None))
    for timeout, end in (
        (stop_timeout_s, BaseProcess.terminate),
        (terminate_timeout_s, BaseProcess.kill),
    ):
        deadline = time.monotonic() + timeout
        for child in children:
            child.process.join(max(0.0, deadline - time.monotonic()))
            if child.process.is_alive():
                end(child.process)
    for child in children:
        child.process.join()
        child.ended = True
        child.commands.close()
        child.results.close()


def _child_main(
    target: Callable[..., None],
    args: tuple[Any, ...],
    commands: connection.Connection,
    results: connection.Connection,
) -> None:
    """A child process: run ``target``; report an exception to the parent, then exit 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        target(*args, commands, results)
    except Exception as error:
        # NOTE: a round trip, not just dumps: an exception whose __init__ takes other
        # arguments than its message pickles, and then fails to unpickle in the parent.
        try:
            pickle.loads(pickle.dumps(error))
            exception: BaseException | None = error
        except Exception:
            exception = None
        with contextlib.suppress(OSError):  # the parent may be gone
            results.send(("failed", ChildFailure(traceback.format_exc(), exception)))
        raise SystemExit(1) from None
