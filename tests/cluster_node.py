"""A cluster role run inside a network namespace by test_mooncake_network.py.

    python cluster_node.py master HOST                    -> a LocalMaster on HOST
    python cluster_node.py node HOST MASTER METADATA SIZE -> a LocalStoreNode on HOST

Prints one JSON line (addresses and the pid of the Mooncake process) once ready, then runs
until its stdin closes. A line ``restart`` on stdin stops the Mooncake process and starts it
again on the same ports (a master restarted by its operator: its objects' metadata is gone),
then prints the JSON line again.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

ROLE_LOG_ENV = "KVTIER_ROLE_LOG"  # a file for the role's Mooncake output (default: an unnamed one)


def main(argv: list[str]) -> int:
    role, host = argv[0], argv[1]
    log = os.environ.get(ROLE_LOG_ENV)  # keep the Mooncake process's output there
    if role == "master":
        started = LocalMaster(host=host, log_path=log).start()
        info = {"master_address": started.master_address, "metadata": started.metadata_server}
    else:
        master = SimpleNamespace(master_address=argv[2], metadata_server=argv[3])
        node = LocalStoreNode(master, int(argv[4]), host=host, log_path=log)  # type: ignore[arg-type]
        started = node.start()
        info = {}
    assert started.process is not None
    print(json.dumps({**info, "pid": started.process.pid}), flush=True)
    for line in sys.stdin:  # until the test closes our stdin (or dies)
        if line.strip() == "restart":
            started.stop()
            started.start()
            print(json.dumps({**info, "pid": started.process.pid}), flush=True)
    started.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
