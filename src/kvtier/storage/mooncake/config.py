"""Reaching a Mooncake master: the backend's config, the environment Mooncake reads, probes
that keep a dead or frozen master from hanging anything, and calls bounded by a deadline."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any

from kvtier.common import bindguard
from kvtier.common.config_sources import positive, refuse_unknown
from kvtier.errors import ConfigError, StorageError, StorageUnavailable

log = logging.getLogger("kvtier.storage.mooncake")

PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeConfig:
    master_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    # Bytes this client contributes to the store. Objects live in the segments of live clients:
    # 0 makes a pure client whose objects live on storage nodes (see mooncake_local.LocalStoreNode).
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 256 << 20
    connect_timeout_s: float = 2.0
    setup_timeout_s: float = 20.0  # a master that accepts TCP but never answers hung setup()
    call_timeout_s: float = 10.0  # a frozen master made every call wait ~30 s

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError("storage.protocol", f"got {self.protocol!r}; allowed: tcp, rdma")
        host, _, port = str(self.master_address).rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                "storage.master_address", f"must be host:port, got {self.master_address!r}"
            )
        for name, least in (("global_segment_size", 0), ("local_buffer_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"storage.{name}", f"must be an integer >= {least}, got {value!r}"
                )
        for name in ("connect_timeout_s", "setup_timeout_s", "call_timeout_s"):
            positive(f"storage.{name}", getattr(self, name))
        for name in ("master_address", "metadata_server", "local_hostname", "device_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"storage.{name}", f"must be text, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MooncakeConfig:
        """From a mapping (``KVTIER_MOONCAKE_<FIELD>`` variables are merged in at the edge, by
        ``kvtier.worker.config``)."""
        known = {f.name for f in fields(cls)}
        refuse_unknown(data, known | {"backend"}, "storage.", "option for the mooncake backend")
        return cls(**{k: v for k, v in data.items() if k in known})


# Mooncake's transfer engine reads its bind address from the environment only (setup() has no
# such option); without it, it binds its RPC port to the first active NIC.
BIND_ADDRESS_ENV = "MC_TCP_BIND_ADDRESS"


def process_environment(config: Mapping[str, Any] | MooncakeConfig) -> dict[str, str]:
    """The environment variables a process must have before it hosts a MooncakeStore built
    from ``config``. Set at the edge (the ``kvtier`` CLI, a launcher's child environment), never
    by the library."""

    if not isinstance(config, MooncakeConfig):
        config = MooncakeConfig.from_dict(
            {k: v for k, v in config.items() if k not in ("faults", "mac_key_file")}
        )
    return {BIND_ADDRESS_ENV: config.local_hostname, **bindguard.environment(config.local_hostname)}


def import_mooncake():
    """The MooncakeDistributedStore class, or a StorageError that says what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        if "libibverbs" in str(e):
            raise StorageError(
                f"Mooncake needs libibverbs.so.1, which is missing: apt-get install -y libibverbs1 "
                f"({e})"
            ) from None
        raise StorageError(
            f"the mooncake backend needs Mooncake: pip install 'kvtier[mooncake]' ({e})"
        ) from None
    return MooncakeDistributedStore


def probe_setup(config: MooncakeConfig) -> None:
    """A throwaway pure client runs ``setup()`` in a child process first, within
    ``setup_timeout_s``. Mooncake's setup holds the interpreter lock while it waits: against a
    master that accepts connections but never answers it froze the whole process for minutes,
    so it is only called here once a child has seen it return."""

    args = [
        sys.executable,
        "-m",
        "kvtier.storage.mooncake.local",
        "probe",
        config.master_address,
        config.metadata_server,
        config.local_hostname,
        config.protocol,
        config.device_name,
    ]
    try:
        out = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=config.setup_timeout_s,
            env={**os.environ, **process_environment(config)},
        )
    except subprocess.TimeoutExpired:
        raise StorageUnavailable(
            f"mooncake master {config.master_address} did not answer setup in time "
            f"({config.setup_timeout_s:.0f} s)"
        ) from None
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise StorageUnavailable(
            f"mooncake setup against {config.master_address} failed: {tail[0][-300:]}"
        )


def probe(address: str, timeout_s: float) -> None:
    """Raise StorageUnavailable unless something accepts TCP connections at ``address``."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise StorageUnavailable(f"mooncake master {address} is unreachable: {e}") from None


class Bounded:
    """Mooncake calls on one thread, each waited for at most ``call_timeout_s``.

    A call that does not return in time cannot be cancelled inside Mooncake: it is left
    running, the store is reported unavailable, and every call fails at once until it returns.
    """

    def __init__(self, name: str, config: MooncakeConfig) -> None:
        self.config = config
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._stuck: Future | None = None

    def check(self, what: str) -> None:
        if self._stuck is not None:
            if not self._stuck.done():
                raise StorageUnavailable(
                    f"mooncake master {self.config.master_address} is not answering ({what}: "
                    "an earlier call is still waiting for it)"
                )
            self._stuck = None
            log.info("mooncake master %s answers again", self.config.master_address)

    def submit(self, what: str, fn, *args) -> Future:
        self.check(what)
        return self._executor.submit(fn, *args)

    def wait(self, what: str, future: Future, timeout_s: float | None = None):
        try:
            return future.result(timeout_s or self.config.call_timeout_s)
        except FutureTimeout:
            self._stuck = future
            log.warning(
                "mooncake master %s did not answer %s within %.0f s",
                self.config.master_address,
                what,
                timeout_s or self.config.call_timeout_s,
            )
            raise StorageUnavailable(
                f"mooncake master {self.config.master_address} did not answer {what} in time"
            ) from None

    def call(self, what: str, fn, *args, timeout_s: float | None = None):
        return self.wait(what, self.submit(what, fn, *args), timeout_s)

    def shutdown(self) -> bool:
        """Stop the thread; True if a call is still stuck (its thread is abandoned)."""
        stuck = self._stuck is not None and not self._stuck.done()
        self._executor.shutdown(wait=not stuck, cancel_futures=True)
        return stuck


def remove_matching(config: Mapping[str, Any] | MooncakeConfig, pattern: str) -> int:
    """Remove every object whose key matches the regular expression ``pattern`` (a pure client
    in a child process, bounded by ``setup_timeout_s + call_timeout_s``); the count removed."""

    if not isinstance(config, MooncakeConfig):
        config = MooncakeConfig.from_dict(config)
    probe(config.master_address, config.connect_timeout_s)
    args = [sys.executable, "-m", "kvtier.storage.mooncake.local", "remove"]
    args += [config.master_address, config.metadata_server, config.local_hostname, pattern]
    try:
        out = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=config.setup_timeout_s + config.call_timeout_s,
            env={**os.environ, **process_environment(config)},
        )
    except subprocess.TimeoutExpired:
        raise StorageUnavailable(
            f"mooncake master {config.master_address} did not answer"
        ) from None
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode != 0 or not last.startswith("removed "):
        raise StorageUnavailable(f"mooncake remove failed: {last or out.stderr.strip()[-300:]}")
    return int(last.split()[1])
