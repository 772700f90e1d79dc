"""What listens where: TCP listeners read from /proc, and private network namespaces.

``listeners(pid)`` gives the addresses a process listens on; with ``whole_namespace`` every
listener in that process's network namespace. ``Namespaces`` builds a private network of
namespaces joined by veth pairs to a bridge in a hub namespace, with addresses that exist only
inside them (root only); everything is deleted on exit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid

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


def namespaces_unavailable() -> str | None:
    """Why private network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"kvtier-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


class Namespaces:
    """Network namespaces named ``<prefix>-<role>``, each with one address on 10.77.<n>.0/24."""

    def __init__(self, roles: list[str], subnet: int = 77, reach_from_root: bool = False) -> None:
        """``reach_from_root``: also join this (the root) namespace to the bridge, as
        10.<subnet>.0.254, so the test itself can reach the namespaces' addresses (the pair
        goes when the hub is deleted)."""
        tag = uuid.uuid4().hex[:5]
        self.hub = f"kvt{tag}-hub"
        self.names = {role: f"kvt{tag}-{role}" for role in roles}
        self.addresses = {role: f"10.{subnet}.0.{i + 1}" for i, role in enumerate(roles)}
        self.root_address = f"10.{subnet}.0.254" if reach_from_root else None
        self._made: list[str] = []

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def __enter__(self) -> Namespaces:
        try:
            self._ip("netns", "add", self.hub)
            self._made.append(self.hub)
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
            for i, (role, ns) in enumerate(self.names.items()):
                self._ip("netns", "add", ns)
                self._made.append(ns)
                inner, outer = f"kvi{i}{self.hub[3:8]}", f"kvo{i}{self.hub[3:8]}"
                self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                self._ip("link", "set", inner, "netns", ns)
                self._ip("link", "set", outer, "netns", self.hub)
                self._ip("-n", self.hub, "link", "set", outer, "master", "br0")
                self._ip("-n", self.hub, "link", "set", outer, "up")
                self._ip("-n", ns, "addr", "add", f"{self.addresses[role]}/24", "dev", inner)
                self._ip("-n", ns, "link", "set", inner, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
            if self.root_address:
                inner, outer = f"kvr{self.hub[3:8]}", f"kvh{self.hub[3:8]}"
                self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                self._ip("link", "set", outer, "netns", self.hub)
                self._ip("-n", self.hub, "link", "set", outer, "master", "br0")
                self._ip("-n", self.hub, "link", "set", outer, "up")
                self._ip("addr", "add", f"{self.root_address}/24", "dev", inner)
                self._ip("link", "set", inner, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def link(self, role: str, up: bool) -> None:
        """Take ``role``'s link to the bridge down (a cable pulled) or bring it up again."""
        i = list(self.names).index(role)
        inner = f"kvi{i}{self.hub[3:8]}"
        self._ip("-n", self.names[role], "link", "set", inner, "up" if up else "down")

    def run(self, role: str, args: list[str], **popen) -> subprocess.Popen:
        """Start ``args`` inside ``role``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[role], *args], **popen)

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()


def start_role(net: Namespaces, role: str, *args: str) -> tuple[subprocess.Popen, dict]:
    """``cluster_node.py ROLE ADDRESS ARGS`` inside ``role``'s namespace; its JSON line."""
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
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(10)
        raise RuntimeError(f"the {role} did not start in its namespace (exit {process.returncode})")
    return process, json.loads(line)
