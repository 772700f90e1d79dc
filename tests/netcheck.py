"""What listens where: TCP listeners read from /proc; private network namespaces
(``kvtier_bench.netns``, shared with the benchmarks) and roles started inside them.

``listeners(pid)`` gives the addresses a process listens on; with ``whole_namespace`` every
listener in that process's network namespace.
"""

from __future__ import annotations

import os
import socket
import subprocess

from cluster_node import ROLE_LOG_ENV
from kvtier_bench.netns import Namespaces, namespaces_unavailable

__all__ = ["Namespaces", "listeners", "namespaces_unavailable", "start_role"]
LISTEN = "0A"


def _address(hex_address: str, v6: bool) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if not v6:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    if ordered[:12] == bytes(10) + b"\xff\xff":  # IPv4-mapped: the IPv4 address it serves
        return f"{socket.inet_ntop(socket.AF_INET, ordered[12:])}:{int(port, 16)}"
    return f"[{socket.inet_ntop(socket.AF_INET6, ordered)}]:{int(port, 16)}"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listeners(pid: int, whole_namespace: bool = False) -> set[str]:
    """``host:port`` of each TCP listener of ``pid`` (or of its network namespace)."""
    mine = None if whole_namespace else _socket_inodes(pid)
    found = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and (mine is None or fields[9] in mine):
                    found.add(_address(fields[1], name == "tcp6"))
    return found


def start_role(
    net: Namespaces, role: str, *args: str, log: str | None = None
) -> tuple[subprocess.Popen, dict]:
    """``cluster_node.py ROLE ADDRESS ARGS`` inside ``role``'s namespace; its JSON line.
    ``log``: a file the role's Mooncake process writes its output to (appended)."""
    import json
    import sys
    from pathlib import Path

    process = net.run(
        role,
        [
            sys.executable,
            str(Path(__file__).parent / "cluster_node.py"),
            role,
            net.addresses[role],
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            **({ROLE_LOG_ENV: log} if log else {}),
        },
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(10)
        raise RuntimeError(f"the {role} did not start in its namespace (exit {process.returncode})")
    return process, json.loads(line)
