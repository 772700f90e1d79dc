"""A Mooncake cluster whose storage node sits behind a slow link, for ``kvtier bench serve
--mooncake-link RATE`` (#30's (e)).

A master and a storage node, each in its own private network namespace joined to a bridge; the
node's link is limited to RATE both ways (a token bucket on each end of its veth pair). The
engines' kvtier workers stay in this namespace and reach both over the bridge as pure Mooncake
clients (their objects live on the node), so every load and save crosses the slow link. A link
delay needs ``tc``'s netem, which not every kernel has (this machine's has not): add latency per
transfer with ``--store-faults '{"transfer_latency_s": 0.005}'`` instead. Root only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier_bench.common import progress
from kvtier_bench.netns import Namespaces, namespaces_unavailable

SUBNET = 79  # 10.79.0.0/24: apart from the tests' namespaces


@contextmanager
def mooncake_behind_link(rate: str, segment_bytes: int) -> Iterator[dict[str, Any]]:
    """The storage mapping of a pure client of such a cluster, while it runs."""
    from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

    why = namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"kvtier bench serve --mooncake-link: {why}")
    with Namespaces(["master", "node"], subnet=SUBNET, reach_from_root=True) as net:
        net.limit("node", rate)
        master = LocalMaster(host=net.addresses["master"], netns=net.names["master"]).start()
        try:
            node = LocalStoreNode(
                master, segment_bytes, host=net.addresses["node"], netns=net.names["node"]
            ).start()
            progress(f"mooncake: master {master.master_address}, node behind a {rate} link")
            try:
                yield master.config(
                    global_segment_size=0,
                    local_buffer_size=64 << 20,
                    local_hostname=net.root_address,
                )
            finally:
                node.stop()
        finally:
            master.stop()
