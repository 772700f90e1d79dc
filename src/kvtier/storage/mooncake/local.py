"""A Mooncake master and storage node on loopback, for tests, benchmarks and the demo.

Production clusters run their own ``mooncake_master`` and storage nodes; these start the same
programs on free loopback ports and stop them again. They are children of the process that
starts them and die with it (``PR_SET_PDEATHSIG``): a SIGKILLed demo leaves no master behind.
Every listener they open is on ``host`` (loopback by default): the master by its flags — and
by the bind guard for its HTTP metadata server, which ignores its host flag — and the store
node by the bind guard (``kvtier.common.bindguard``).
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from kvtier.common import bindguard
from kvtier.common.interrupts import die_with_parent
from kvtier.errors import StorageError, StorageUnavailable
from kvtier.storage.mooncake.config import BIND_ADDRESS_ENV, probe

LIBIBVERBS_HINT = "libibverbs.so.1 is missing: apt-get install -y libibverbs1"


def find_master_binary() -> str:
    """``mooncake_master`` next to the running Python (an unactivated venv's bin), or on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise StorageError(
            f"mooncake_master not found next to {sys.executable} or on PATH: "
            "pip install 'kvtier[mooncake]'"
        )
    return found


def _explain_exit(code: int | None, stderr_tail: str) -> str:
    if "libibverbs" in stderr_tail:
        return LIBIBVERBS_HINT
    return f"exited with code {code}: {stderr_tail.strip()[-500:] or '(no output)'}"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (this namespace's):
    a port found free can be taken by another process before the master binds it, and a
    probe would then reach that process's master (another test's), not this one's."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if len(row) > 9 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{row[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds)
    except OSError:  # gone, or a descriptor closed while looking
        return False


def _guarded_environment(host: str) -> dict[str, str]:

    return {**os.environ, BIND_ADDRESS_ENV: host, **bindguard.environment(host)}


class LocalMaster:
    """A ``mooncake_master`` with its embedded HTTP metadata server on free loopback ports.

    For tests, benchmarks and the demo; production clusters run their own master. Started by
    ``start()`` (waits for the RPC port), stopped by ``stop()`` (SIGTERM, then SIGKILL).
    """

    def __init__(
        self,
        lease_ttl_ms: int | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        log_path: str | None = None,
    ) -> None:
        """``netns``: run inside that network namespace (``host`` is one of its addresses; any
        port free here is free in a namespace nothing else runs in). ``log_path``: keep what
        it prints in that file (appended) rather than in an unnamed one."""
        self.host, self.netns, self.log_path = host, netns, log_path
        here = "127.0.0.1" if netns else host
        self.rpc_port = _free_port(here)
        self.http_port = _free_port(here)
        self.metrics_port = _free_port(here)
        self.lease_ttl_ms = lease_ttl_ms
        self.process: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> dict[str, Any]:
        return {
            "backend": "mooncake",
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            **overrides,
        }

    def start(self, timeout_s: float = 20.0) -> LocalMaster:
        binary = find_master_binary()
        args = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        # Its output goes to a file: read back when it fails, never a pipe that could fill.
        self._log = _log_file(self.log_path)
        self.process = subprocess.Popen(
            _in_netns(self.netns, args),
            stdout=self._log,
            stderr=self._log,
            env=_guarded_environment(self.host),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StorageError(
                    "mooncake_master " + _explain_exit(self.process.returncode, self.output())
                )
            try:
                probe(self.master_address, 0.2)
                if self.netns is not None or _listens(self.process.pid, self.rpc_port):
                    return self
            except StorageUnavailable:
                pass
            time.sleep(0.05)  # a free port another process took meanwhile: this one exits
        self.stop()
        raise StorageError(f"mooncake_master did not listen on {self.master_address} in time")

    def output(self) -> str:
        """What mooncake_master printed so far (its log)."""
        if getattr(self, "_log", None) is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

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

    def __init__(
        self,
        master: LocalMaster,
        segment_bytes: int,
        host: str = "127.0.0.1",
        netns: str | None = None,
        log_path: str | None = None,
    ) -> None:
        """``log_path``: keep what it prints in that file (appended)."""
        self.master = master
        self.segment_bytes = segment_bytes
        self.host, self.netns, self.log_path = host, netns, log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> LocalStoreNode:
        env = _guarded_environment(self.host)
        self._log = _log_file(self.log_path)
        self.process = subprocess.Popen(
            _in_netns(
                self.netns,
                [
                    sys.executable,
                    "-m",
                    "kvtier.storage.mooncake.local",
                    self.master.master_address,
                    self.master.metadata_server,
                    str(self.segment_bytes),
                    self.host,
                ],
            ),
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        ready = _read_line(self.process, timeout_s)
        if ready.strip() != "ready":
            self.stop()
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace")
            why = LIBIBVERBS_HINT if "libibverbs" in tail else f"{ready!r} {tail.strip()[-500:]}"
            raise StorageError(f"mooncake store node did not start: {why}")
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


def _log_file(path: str | None) -> BinaryIO:
    """A process's log: ``path`` appended to (created private; a link, a file that is not
    regular or not this user's is refused), or an unnamed file that lives as long as the
    process."""
    if path is None:
        return tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise StorageError(f"cannot open the log {path}: {e}") from None
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
        os.close(fd)
        raise StorageError(f"the log {path} is not a regular file of this user: refused")
    return os.fdopen(fd, "ab+")


def _in_netns(netns: str | None, args: list[str]) -> list[str]:
    """``args``, run inside network namespace ``netns`` when one is named (``ip netns exec``
    execs the command: the process keeps its pid and its parent-death signal)."""
    return ["ip", "netns", "exec", netns, *args] if netns else args


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:

    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return "(timed out)"
    return process.stdout.readline().decode(errors="replace")


def _serve_segment(master_address: str, metadata_server: str, segment_bytes: int, host: str) -> int:
    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata_server, segment_bytes, 16 << 20, "tcp", "", master_address)
    print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
    if rc == 0:
        stop.wait()
        store.close()
    return 0 if rc == 0 else 1


def _probe_setup(master: str, metadata: str, host: str, protocol: str, device: str) -> int:
    """A pure client's setup() and close(): exit 0 if the master answered."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata, 0, 16 << 20, protocol, device, master)
    print(f"setup returned {rc}", flush=True)
    if rc == 0:
        store.close()
    return 0 if rc == 0 else 1


def _remove_matching(master: str, metadata: str, host: str, pattern: str) -> int:
    """A pure client removes every object whose key matches ``pattern``; prints the count."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata, 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup returned {rc}", flush=True)
        return 1
    removed = store.remove_by_regex(pattern, True)
    print(f"removed {removed}", flush=True)
    store.close()
    return 0 if removed >= 0 else 1


if __name__ == "__main__":
    if sys.argv[1] == "remove":
        os._exit(_remove_matching(*sys.argv[2:6]))  # noqa: SLF001
    if sys.argv[1] == "probe":
        os._exit(_probe_setup(*sys.argv[2:7]))  # noqa: SLF001 - no teardown of Mooncake needed
    raise SystemExit(_serve_segment(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
