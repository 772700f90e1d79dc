"""Private network namespaces for tests and benchmarks (root only): a hub namespace with a
bridge, each role's namespace joined to it by a veth pair, addresses that exist only inside
them; links that can be pulled or slowed. Everything is deleted on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


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

    def limit(self, role: str, rate: str) -> None:
        """Slow ``role``'s link to ``rate`` (tc's units: ``1gbit``, ``100mbit``) both ways: a
        token bucket on each end of its veth pair."""
        i = list(self.names).index(role)
        ends = ((self.names[role], f"kvi{i}{self.hub[3:8]}"), (self.hub, f"kvo{i}{self.hub[3:8]}"))
        for ns, dev in ends:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
                + ["rate", rate, "burst", "1mb", "latency", "200ms"],
                check=True,
                capture_output=True,
            )

    def run(self, role: str, args: list[str], **popen) -> subprocess.Popen:
        """Start ``args`` inside ``role``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[role], *args], **popen)

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
