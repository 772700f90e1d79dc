"""Start ``kvtier serve`` processes for a Client, and clean up after launchers that died.

Each worker reads its YAML config on standard input. A launch makes a private directory (0700)
that the launcher holds a lock on (``.owner.lock``) for as long as its client lives; the
workers log there unless ``log_dir`` says otherwise.
A directory whose lock can be taken belongs to a launcher that died (SIGKILL, OOM): the next
launch on the machine removes it (``kvtier.worker.orphans.reclaim_launch_dirs``).

Workers are started so that they import kvtier from the installed package, whatever the
caller's working directory holds, and know their launcher's pid: they exit within a poll
interval when it is gone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.common.config_sources import Source
from kvtier.common.cpus import OMP_PLACEMENT_VARIABLES
from kvtier.common.interrupts import deferred_interrupts
from kvtier.common.user_dirs import check_parent_directory, make_user_directory
from kvtier.engine import reaper
from kvtier.errors import ConfigError
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory import shm
from kvtier.storage import mooncake_config, process_environment
from kvtier.transport.endpoint import reclaim_endpoint
from kvtier.worker.config import WorkerConfig, env_sources, resolve
from kvtier.worker.orphans import LAUNCH_DIR_PREFIX, OWNER_LOCK, reclaim_orphans

log = logging.getLogger(__name__)

# `python -m kvtier.ops.cli` would put the working directory first on sys.path: a `kvtier/` folder
# there (a checkout, say) would shadow the installed package and every worker would die.
SERVE_COMMAND = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; from kvtier.ops.cli import run; run()"
)


@dataclass
class Launch:
    """What a launch started: per rank its config, process and log; the directory and its lock."""

    configs: list[WorkerConfig]
    processes: list[subprocess.Popen] = field(default_factory=list)
    log_paths: list[Path] = field(default_factory=list)
    directory: Path | None = None
    lock_fd: int | None = None
    reaper_pid: int | None = None  # cleans up after a launcher killed with its whole tree

    @property
    def endpoints(self) -> list[str]:
        return [c.endpoint_address for c in self.configs]

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{_tail(p, lines)}" for p in self.log_paths if p.exists()
        )

    def last_errors(self) -> str:
        """The last error line each worker logged (a one-line summary of a failed start)."""
        found = []
        for path in self.log_paths:
            if not path.exists():
                continue
            lines = path.read_text(errors="replace").splitlines()
            errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
            if errors:
                found.append(f"{path.stem}: {errors[-1].strip()[-300:]}")
        return "; ".join(found)

    def kill(self) -> None:
        """SIGKILL every worker, then remove what they could not: sockets, locks, shm files."""
        for p in self.processes:
            if p.poll() is None:
                p.kill()
        for p in self.processes:
            p.wait()
        for endpoint in self.endpoints[: len(self.processes)]:
            reclaim_endpoint(endpoint)
        shm.reclaim_orphans()

    def remove_directory(self) -> None:
        if self.reaper_pid is not None:
            reaper.stop(self.reaper_pid)  # ended cleanly: nothing for it to do
            self.reaper_pid = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def worker_configs(
    spec: KVCacheSpec,
    world_size: int,
    storage: dict[str, Any] | None,
    instance_id: str,
    ranks: Sequence[int] | None,
    settings: dict[str, Any],
    source: str = "Client.launch",
) -> list[WorkerConfig]:
    """Validated configs of the ranks to launch (all of them unless ``ranks``): the
    ``KVTIER_*`` environment, then the arguments (``source`` names them in errors), field by
    field, as ``kvtier serve`` merges its environment and flags."""
    settings = dict(settings)
    base_port = settings.pop("metrics_port", None)
    configs = []
    for rank in range(world_size) if ranks is None else ranks:
        per_rank = dict(settings)
        if base_port is not None:  # each rank its own exporter: base + rank, or 0 for any
            per_rank["metrics_port"] = base_port + rank if base_port else 0
        if str(settings.get("endpoint", "")).startswith("tcp://"):
            per_rank["endpoint"] = _tcp_for_rank(settings["endpoint"], rank)
        given = {
            "spec": spec,
            "instance_id": instance_id,
            "rank": rank,
            "world_size": world_size,
            "storage": storage,
            "parent_pid": os.getpid(),
            **per_rank,
        }
        configs.append(resolve([*env_sources(os.environ), Source(source, given)]))
    return configs


def _tcp_for_rank(endpoint: str, rank: int) -> str:
    """Rank r of a ``tcp://HOST:PORT`` launch listens on PORT + r (as metrics ports do)."""
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError("endpoint", f"a tcp:// endpoint needs a port, got {endpoint!r}")
    return f"{host}:{int(port) + rank}"


def _environment(config: WorkerConfig) -> dict[str, str]:
    """A worker's environment: ours without an engine's OpenMP binding (``cpu_cores`` places
    the worker), plus what Mooncake needs from the start (bind guard)."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_PLACEMENT_VARIABLES}

    mooncake = mooncake_config(config.storage_config)
    if mooncake is None:
        return env

    return {**env, **process_environment(mooncake)}


def start_workers(
    configs: list[WorkerConfig], log_dir: str | Path | None, reaper_too: bool = False
) -> Launch:
    """Write the configs and start one ``kvtier serve`` per config. On failure nothing runs.

    ``reaper_too``: also start a reaper (``kvtier.engine.reaper``) that removes what the launch
    leaves if this process is killed together with its workers (vLLM kills its workers' whole
    process trees)."""
    if log_dir is not None:
        try:  # the user's directory: made if missing (only the user may read the logs)
            make_user_directory(log_dir, 0o700, "log_dir")
        except OSError as e:
            raise ConfigError("log_dir", f"cannot create {log_dir}: {e.strerror}") from None
    reclaim_orphans()
    launch = Launch(configs)
    with deferred_interrupts():  # a directory without its lock would never be reclaimed
        launch.directory, launch.lock_fd = _private_directory(configs[0].instance_id)
    try:
        for cfg in configs:
            log_path = Path(log_dir or launch.directory) / f"rank{cfg.rank}.log"
            with _open_log(log_path) as out:
                process = subprocess.Popen(
                    [sys.executable, "-c", SERVE_COMMAND, "serve", "--config-is-complete"]
                    + ["--config", "-", "--launched-as", f"{cfg.instance_id}:rank{cfg.rank}"],
                    stdout=out,
                    stderr=out,
                    stdin=subprocess.PIPE,
                    env=_environment(cfg),
                )
            launch.processes.append(process)
            launch.log_paths.append(log_path)
            _hand_config(process, cfg)
        if reaper_too:
            try:
                launch.reaper_pid = reaper.start(os.getpid(), [p.pid for p in launch.processes])
            except OSError as e:  # a safety net: the workers run without it
                log.warning(
                    "no reaper for this launch (%s): a kill of this process tree may "
                    "leave files until the next kvtier start",
                    e,
                )
    except BaseException:
        with deferred_interrupts():
            launch.kill()
            launch.remove_directory()
        raise
    return launch


TERMINATE_GRACE_S = 2.0  # a worker that will not get (or did not answer) a shutdown


def end_worker(process: subprocess.Popen, endpoint: str, wait_s: float) -> None:
    """Wait up to ``wait_s`` for a worker to exit, then terminate (and kill) it; remove the
    socket a killed worker could not unlink."""
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        if wait_s > 1:
            log.warning("worker %d did not exit; terminating it", process.pid)
        process.terminate()
        try:
            process.wait(TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    reclaim_endpoint(endpoint)  # a killed worker's; never another live worker's


def _open_log(path: Path) -> Any:
    """A worker's log, opened in a directory already walked (``make_user_directory``, or the
    launch's own 0700 one): never through a link planted there, never another user's file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError("log_dir", f"{path} is not a file of yours: remove it")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")


def _hand_config(process: subprocess.Popen, config: WorkerConfig) -> None:
    """The worker reads its whole config on standard input (``--config -``): no file in a
    directory that another user might rename and replace between the write and the read."""
    assert process.stdin is not None
    try:
        process.stdin.write(yaml.safe_dump(config.to_dict()).encode())
    except BrokenPipeError:
        pass  # it died before reading: its exit and log tell why (the launch waits for it)
    finally:
        try:
            process.stdin.close()
        except BrokenPipeError:
            pass


def _private_directory(instance_id: str) -> tuple[Path, int]:
    check_parent_directory(tempfile.gettempdir(), "TMPDIR")
    path = Path(tempfile.mkdtemp(prefix=f"{LAUNCH_DIR_PREFIX}{instance_id}-"))
    fd = os.open(path / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
