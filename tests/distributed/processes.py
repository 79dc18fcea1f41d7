"""Processes started by a test, to assert that none is left behind, and what they listen on."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from multiprocessing import resource_tracker
from pathlib import Path

_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


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


def session_pids(session_id: int) -> set[int]:
    """Every live process of session ``session_id``: a process started with
    ``start_new_session=True`` and all it started, orphans too (they keep the session)."""
    found: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # After the command: state, parent, process group, session.
        if fields[0] != "Z" and int(fields[3]) == session_id:
            found.add(int(stat.parent.name))
    return found


def listening_addresses(pids: Iterable[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket on which one of ``pids`` listens."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except FileNotFoundError:  # closed while we looked
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found: set[tuple[str, int]] = set()
    # NOTE: the tables list every socket of the network namespace; the inodes pick ours.
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{os.getpid()}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _TCP_LISTEN and inode in inodes:
                address, port = local.split(":")
                found.add((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return str(ipaddress.ip_address(b"".join(words)))
