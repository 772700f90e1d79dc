"""A Mooncake master and storage node on loopback, for tests, benchmarks and the demo.

Production clusters run their own ``mooncake_master`` and storage nodes; these start the same
programs on free loopback ports and stop them again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from kvtier.errors import StorageError, StorageUnavailable
from kvtier.storage.mooncake import probe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMaster:
    """A ``mooncake_master`` with its embedded HTTP metadata server on free loopback ports.

    For tests, benchmarks and the demo; production clusters run their own master. Started by
    ``start()`` (waits for the RPC port), stopped by ``stop()`` (SIGTERM, then SIGKILL).
    """

    def __init__(self, lease_ttl_ms: int | None = None) -> None:
        self.rpc_port = _free_port()
        self.http_port = _free_port()
        self.metrics_port = _free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.process: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> dict[str, Any]:
        return {
            "backend": "mooncake",
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            **overrides,
        }

    def start(self, timeout_s: float = 20.0) -> LocalMaster:
        binary = shutil.which("mooncake_master")
        if binary is None:
            raise StorageError("mooncake_master not found: pip install 'kvtier[mooncake]'")
        args = [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StorageError(f"mooncake_master exited with {self.process.returncode}")
            try:
                probe(self.master_address, 0.2)
                return self
            except StorageUnavailable:
                time.sleep(0.05)
        self.stop()
        raise StorageError(f"mooncake_master did not listen on {self.master_address} in time")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalStoreNode:
    """A process that contributes ``segment_bytes`` of memory to a Mooncake store and idles.

    The shape of a cluster deployment on one machine: engines' workers are pure clients
    (``global_segment_size=0``) and the objects live in a storage node's segment, reached over
    TCP (or RDMA). Started by ``start()``, which returns once the segment is mounted.
    """

    def __init__(self, master: LocalMaster, segment_bytes: int) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> LocalStoreNode:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.storage.mooncake_local",
                self.master.master_address,
                self.master.metadata_server,
                str(self.segment_bytes),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        ready = _read_line(self.process, timeout_s)
        if ready.strip() != "ready":
            self.stop()
            raise StorageError(f"mooncake store node did not start: {ready!r}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def __enter__(self) -> LocalStoreNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return "(timed out)"
    return process.stdout.readline().decode(errors="replace")


def _serve_segment(master_address: str, metadata_server: str, segment_bytes: int) -> int:
    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1", metadata_server, segment_bytes, 16 << 20, "tcp", "", master_address
    )
    print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
    if rc == 0:
        stop.wait()
        store.close()
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(_serve_segment(sys.argv[1], sys.argv[2], int(sys.argv[3])))
