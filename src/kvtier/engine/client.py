"""Client: the engine's side. Fans each task out to every rank and gathers one answer.

The I/O thread (``kvtier.engine.supervisor.Supervisor``) owns the transport: it sends tasks and
heartbeats, receives results, and watches the workers; a task's future resolves exactly once
(aggregated result, ``WorkerLost`` or ``TaskTimeout``) — never a hang.

Start-up and supervision are separate: until a rank has answered the hello it is bounded only
by ``start_timeout_s`` (a worker may need many seconds to import torch and pre-touch a large
host pool on a busy machine) and by its process: one that exits fails the start at once, with
its log. Heartbeat supervision starts with the welcome.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvtier.common.interrupts import deferred_interrupts
from kvtier.engine.fanin import ControlAnswer, TaskFuture, aggregate
from kvtier.engine.launcher import Launch, end_worker, start_workers, worker_configs
from kvtier.engine.ranks import Rank, blocked_save
from kvtier.engine.supervisor import Supervisor
from kvtier.errors import TaskTimeout, WorkerError
from kvtier.layout.spec import KVCacheSpec
from kvtier.transport import tasks as t
from kvtier.transport.auth import CurveKeys
from kvtier.worker.config import START_TIMEOUT_S

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
BLOCKED_REPORT_FRESH = 3  # a blocked save's report counts for this many heartbeat intervals
WORKER_TIMEOUT_S = 5.0
TASK_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 30.0
INTERRUPTED_WAIT_S = 0.5  # a close cut short by Ctrl-C: workers get SIGTERM after this


class Client:
    """Sends tasks to one worker per rank and answers each exactly once.

    ``endpoints`` lists the workers to talk to, in rank order. Options: ``task_timeout_s``
    (default for each task), ``worker_timeout_s`` (heartbeat silence that loses a rank),
    ``heartbeat_interval_s``. Thread-safe: any thread may submit; results resolve futures from
    the I/O thread (callbacks run there: keep them short).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        processes: Sequence[subprocess.Popen | None] | None = None,
        task_timeout_s: float = TASK_TIMEOUT_S,
        worker_timeout_s: float = WORKER_TIMEOUT_S,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        auth_key: bytes | None = None,
        auth_key_file: str | None = None,
        observer: bool = False,  # `kvtier status`: stats only; never keeps a worker alive
    ) -> None:
        curve = (
            CurveKeys.from_secret(auth_key)
            if auth_key
            else CurveKeys.from_file(auth_key_file)
            if auth_key_file
            else None
        )
        self.task_timeout_s = task_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        procs = list(processes) if processes is not None else [None] * len(endpoints)
        ranks = [Rank(i, e, process=p) for i, (e, p) in enumerate(zip(endpoints, procs))]
        self.client_id = uuid.uuid4().hex[:12]
        hello = t.Hello(
            protocol_version=t.PROTOCOL_VERSION, client_id=self.client_id, observer=observer
        )
        self._io = Supervisor(ranks, hello, curve, worker_timeout_s, heartbeat_interval_s)
        self._ranks = self._io.ranks
        self._ids = itertools.count(1)
        self._launch: Launch | None = None

    @property
    def world_size(self) -> int:
        """How many workers this client talks to."""
        return len(self._ranks)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers this client launched."""
        return [r.process.pid for r in self._ranks if r.process is not None]

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def connect(
        cls, endpoints: Sequence[str], start_timeout_s: float = START_TIMEOUT_S, **options: Any
    ) -> Client:
        """Talk to workers that are already running (``kvtier serve``), or are starting: each
        must answer the hello within ``start_timeout_s``. ``options`` as for ``Client``."""
        return cls(endpoints, **options).start(start_timeout_s)

    @classmethod
    def launch(
        cls,
        spec: KVCacheSpec,
        world_size: int = 1,
        storage: dict[str, Any] | None = None,
        *,
        instance_id: str | None = None,
        ranks: Sequence[int] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        log_dir: str | Path | None = None,
        client_options: dict[str, Any] | None = None,
        reaper: bool = False,
        **worker_settings: Any,
    ) -> Client:
        """Start one ``kvtier serve`` process per rank and wait until all are ready.

        ``ranks`` starts only those ranks of ``world_size`` (the process that owns TP rank r
        launches rank r). ``worker_settings`` are WorkerConfig fields shared by every rank
        (num_host_blocks, device_cache_mode, namespace, model_dir, engine_timeout_s,
        metrics_port: each rank serves on metrics_port + rank, ...); each rank's device cache is
        named ``kvtier-{instance_id}-rank{r}-dev0`` unless ``device_cache`` names it.
        ``client_options`` are Client options; ``reaper`` starts a process outside this one's
        tree that cleans up if this process is killed together with the workers (as vLLM
        kills its workers). The workers' logs go to ``log_dir`` (default:
        the private launch directory, removed by ``close``); a failed start raises WorkerError
        with the tail of every log.
        """
        instance_id = instance_id or uuid.uuid4().hex[:10]
        worker_settings.setdefault("start_timeout_s", start_timeout_s)  # its wait for a hello
        configs = worker_configs(spec, world_size, storage, instance_id, ranks, worker_settings)
        launch = start_workers(configs, log_dir, reaper)
        return cls.from_launch(launch, start_timeout_s, **(client_options or {}))

    @classmethod
    def from_launch(
        cls, launch: Launch, start_timeout_s: float = START_TIMEOUT_S, **options: Any
    ) -> Client:
        """A client for workers ``kvtier.engine.launcher.start_workers`` started (they may still be
        starting); it owns them from now on. On failure they are ended and the error carries
        each worker's last error line (and their log tails after the first line)."""
        secret = launch.configs[0].auth_key_file
        if secret and "auth_key" not in options:
            options.setdefault("auth_key_file", secret)  # tcp:// workers: the same secret
        try:
            client = cls(launch.endpoints, processes=launch.processes, **options)
            client.start(start_timeout_s)
            client._launch = launch  # from now on close() removes the launch directory
            return client
        except WorkerError as e:
            with deferred_interrupts():
                launch.kill()
                summary, tails = launch.last_errors(), launch.log_tails()
                launch.remove_directory()
            raise WorkerError(f"{e}{' (' + summary + ')' if summary else ''}\n{tails}") from None
        except BaseException:
            with deferred_interrupts():
                launch.kill()
                launch.remove_directory()
            raise

    def start(self, start_timeout_s: float = START_TIMEOUT_S) -> Client:
        """Connect and wait for every rank's welcome (see the module docstring)."""
        self._io.open()
        settled = self._io.wait_settled(start_timeout_s)
        failed = [r for r in self._ranks if r.lost]
        if failed:
            self._abort()
            r = failed[0]
            if r.lost_error is WorkerError:
                raise WorkerError(f"rank {r.position} did not start: {r.lost}")
            raise r.lost_error(f"rank {r.position}: {r.lost}")
        if not settled:
            self._abort()
            missing = [r.position for r in self._ranks if not r.welcomed]
            raise WorkerError(
                f"ranks {missing} not ready after {start_timeout_s:.0f} s "
                "(start_timeout_s): still starting, or not running"
            )
        log.info("client %s: %d ranks ready", self.client_id, self.world_size)
        return self

    # ---- tasks ------------------------------------------------------------------------------

    def submit(self, task: Any, timeout_s: float | None = None) -> TaskFuture:
        """Send ``task`` to every rank (its ``task_id`` is replaced by a fresh one).

        Returns a Future of the aggregated ``Result``; it fails with WorkerLost or TaskTimeout
        (``timeout_s``, default ``task_timeout_s``), never hangs.
        """
        timeout_s = timeout_s or self.task_timeout_s
        task = _stamped(task, next(self._ids), timeout_s)
        future = TaskFuture()
        self._io.send(task, future, time.monotonic() + timeout_s)
        return future

    def _call(self, task: Any, timeout_s: float | None) -> t.Result:
        """``task``'s answer: on this thread's own connection when it can
        (``kvtier.engine.direct``), else through the I/O thread."""
        timeout_s = timeout_s or self.task_timeout_s
        task = _stamped(task, next(self._ids), timeout_s)
        deadline = time.monotonic() + timeout_s
        result = self._io.call(task, deadline)
        if result is not None:
            return result
        future = TaskFuture()
        self._io.send(task, future, deadline)
        return future.result()

    def swap_out(self, device_block_ids, host_block_ids, timeout_s=None) -> t.Result:
        """Device blocks -> host blocks (pairwise); ``blocks``: the device ids done."""
        task = t.SwapOut(
            device_block_ids=_ids(device_block_ids), host_block_ids=_ids(host_block_ids)
        )
        return self._call(task, timeout_s)

    def swap_in(self, host_block_ids, device_block_ids, timeout_s=None) -> t.Result:
        """Host blocks -> device blocks (pairwise); ``blocks``: the device ids done."""
        task = t.SwapIn(
            host_block_ids=_ids(host_block_ids), device_block_ids=_ids(device_block_ids)
        )
        return self._call(task, timeout_s)

    def save(self, block_hashes, device_block_ids, timeout_s=None) -> t.Result:
        """Device -> storage, skipping the stored prefix; ``blocks``: the prefix now stored."""
        task = t.Save(block_hashes=list(block_hashes), device_block_ids=_ids(device_block_ids))
        return self._call(task, timeout_s)

    def load(self, block_hashes, device_block_ids, timeout_s=None) -> t.Result:
        """Storage -> device, the longest stored prefix; ``blocks``: the device ids filled."""
        task = t.Load(block_hashes=list(block_hashes), device_block_ids=_ids(device_block_ids))
        return self._call(task, timeout_s)

    def save_host(self, block_hashes, host_block_ids, timeout_s=None) -> t.Result:
        """Host -> storage; ``blocks``: the prefix of host ids now stored."""
        task = t.SaveHost(block_hashes=list(block_hashes), host_block_ids=_ids(host_block_ids))
        return self._call(task, timeout_s)

    def load_host(self, block_hashes, host_block_ids, timeout_s=None) -> t.Result:
        """Storage -> host; ``blocks``: the prefix of host ids filled."""
        task = t.LoadHost(block_hashes=list(block_hashes), host_block_ids=_ids(host_block_ids))
        return self._call(task, timeout_s)

    def lookup(self, block_hashes, timeout_s=None) -> int:
        """How many leading blocks every rank has stored."""
        return self.lookup_tiers(block_hashes, timeout_s)[0]

    def lookup_tiers(self, block_hashes, timeout_s=None) -> tuple[int, bytes]:
        """How many leading blocks every rank has stored, and the tier each would load from
        (one byte per block, 0 = the fastest; empty: all from the first tier)."""
        result = self._call(t.Lookup(block_hashes=list(block_hashes)), timeout_s)
        return result.count, result.tiers

    def control(self, method: str, timeout_s: float | None = None, **args: Any) -> ControlAnswer:
        """pause, resume, update_weights [version=...], sleep, wakeup or stats, on every rank."""
        future = self.submit(t.Control(method=method, args=args), timeout_s)
        result: t.Result = future.result()
        return ControlAnswer(result.code, result.message, future.per_rank)

    def blocked_save(self) -> tuple[int, float] | None:
        """(blocks, seconds) of the save blocked longest on its store, over ranks, as their
        latest heartbeats tell; None when none is (``kvtier.engine.ranks.blocked_save``)."""
        return blocked_save(self._ranks, BLOCKED_REPORT_FRESH * self.heartbeat_interval_s)

    def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip of a heartbeat to every rank (the raw transport latency), in seconds."""
        start = time.perf_counter()
        if not self._io.ping(timeout_s):
            raise TaskTimeout("ping not answered")
        return time.perf_counter() - start

    # ---- shutdown ---------------------------------------------------------------------------

    def close(
        self, timeout_s: float = CLOSE_TIMEOUT_S, shutdown_workers: bool | None = None
    ) -> None:
        """Stop. Workers this client launched are shut down cleanly (they answer what they
        hold); workers it only connected to are left running unless ``shutdown_workers``.
        Never waits for a worker that is gone or never started: those are ended at once."""
        if not self._io.running:
            return
        if shutdown_workers is None:
            shutdown_workers = any(r.process is not None for r in self._ranks)
        self._io.closing = True
        interrupted = True
        try:
            if shutdown_workers:
                self._shut_down_workers(timeout_s)
            interrupted = False
        finally:
            with deferred_interrupts():  # what the workers leave is removed whatever comes
                self._release(INTERRUPTED_WAIT_S if interrupted else timeout_s)

    def _release(self, timeout_s: float) -> None:
        if self._io.running:
            self._end_processes(timeout_s)
            self._io.stop()
            if self._launch is not None:
                self._launch.remove_directory()

    def _abort(self) -> None:
        """A failed start: end every process now (no graceful shutdown), then close."""
        for r in self._ranks:
            if r.process is not None and r.process.poll() is None:
                r.process.kill()
        self.close(timeout_s=1.0, shutdown_workers=False)

    def _shut_down_workers(self, timeout_s: float) -> None:
        live = {
            r.position
            for r in self._ranks
            if r.welcomed and not r.lost and (r.process is None or r.process.poll() is None)
        }
        if not live:
            return
        task = t.Shutdown(task_id=next(self._ids))
        future = TaskFuture()
        self._io.send(task, future, time.monotonic() + timeout_s, expected=live)
        try:
            future.result(timeout_s + 1)
        except Exception as e:  # a lost or slow worker: its process is ended below
            log.warning("client: shutdown was not answered by every rank: %s", e)

    def _end_processes(self, timeout_s: float) -> None:
        """Wait for workers that answered the shutdown; end the others now."""
        deadline = time.monotonic() + timeout_s
        for r in self._ranks:
            if r.process is not None:
                answered = r.welcomed and not r.lost  # it got a shutdown: give it time
                wait_s = max(0.1, deadline - time.monotonic()) if answered else 0.05
                end_worker(r.process, r.endpoint, wait_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ids(ids: Any) -> list[int]:
    return [int(i) for i in ids]


def _stamped(task: Any, task_id: int, timeout_s: float) -> Any:
    """``task`` with its id and, for a data task, the time it has (``t.TimeoutMs``): the worker
    leaves its blocks alone once that is over, for the engine may reuse them then."""
    if isinstance(task, t.DATA_TASKS):
        timeout_ms = min(t.MAX_TIMEOUT_MS, max(1, int(timeout_s * 1000)))
        return msgspec.structs.replace(task, task_id=task_id, timeout_ms=timeout_ms)
    return msgspec.structs.replace(task, task_id=task_id)


__all__ = ["Client", "ControlAnswer", "TaskFuture", "aggregate"]
