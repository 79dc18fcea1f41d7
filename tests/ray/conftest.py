"""One local two-node Ray cluster (1 CPU each) for every Ray test, on the loopback address
only, shut down at the end with nothing of it left running."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.processes import alive, descendant_pids

REPO_ROOT = Path(__file__).resolve().parents[2]

# NOTE: before Ray is imported (its constants read this at import time), and inherited by
# the CLI and example subprocesses. Ray then takes the loopback address as the node address
# (as it does on macOS) instead of the address of the host's network interface: every node
# listens on 127.0.0.1 only, and ray.init, which rewrites 127.0.0.1 to the node address,
# keeps it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _listening_addresses(pids: set[int]) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses that the TCP sockets of these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            columns = line.split()
            local, state, inode = columns[1], columns[3], columns[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            # Each 32-bit word of the address is written little-endian in hex.
            hex_address = local.split(":")[0]
            words = [
                bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)
            ]
            addresses.add(ipaddress.ip_address(b"".join(words)))
    return addresses


@pytest.fixture(scope="package")
def ray_address() -> Iterator[str]:
    """The address of a started two-node cluster, which this process is connected to."""
    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    before = descendant_pids()
    cluster = Cluster()
    try:
        with pytest.MonkeyPatch.context() as patch:
            # The nodes' workers import this checkout (the test modules' functions too),
            # and take one thread each.
            patch.setenv(
                "PYTHONPATH",
                os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            )
            patch.setenv("OMP_NUM_THREADS", "1")
            cluster.add_node(num_cpus=1, include_dashboard=False)
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        # NOTE: every actor of a pool is up before the first batch is handed out, so that
        # both nodes take part however slowly one of them starts.
        context.wait_for_min_actors_s = 180
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2
        yield cluster.address
        listening = _listening_addresses(descendant_pids() - before)
        assert listening and all(
            (getattr(address, "ipv4_mapped", None) or address).is_loopback for address in listening
        ), listening
    finally:
        started = descendant_pids() - before
        ray.shutdown()
        cluster.shutdown()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if alive(pid)], "Ray processes outlived the cluster"
