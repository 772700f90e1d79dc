"""Client: the engine's side. Fans each task out to every rank and gathers one answer.

One I/O thread owns the transport: it sends tasks and heartbeats, receives results, and watches
the workers. A task's future resolves when every rank has answered: blocks are the shortest
prefix over ranks, the status the worst. It fails with ``WorkerLost`` when a rank's process
exits or its heartbeats stop for ``worker_timeout_s``, and with ``TaskTimeout`` after
``task_timeout_s`` — never a hang.

Start-up and supervision are separate: until a rank has answered the hello it is bounded only
by ``start_timeout_s`` (a worker may need many seconds to import torch and pre-touch a large
host pool on a busy machine) and by its process: one that exits fails the start at once, with
its log. Heartbeat supervision starts with the welcome.
"""

from __future__ import annotations

import itertools
import logging
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvtier import tasks as t
from kvtier.auth import CurveKeys
from kvtier.config import START_TIMEOUT_S
from kvtier.errors import ProtocolMismatch, TaskTimeout, WorkerError, WorkerLost
from kvtier.fanin import ControlAnswer, TaskFuture, aggregate
from kvtier.interrupts import deferred_interrupts
from kvtier.launcher import Launch, end_worker, start_workers, worker_configs
from kvtier.ranks import Rank
from kvtier.spec import KVCacheSpec
from kvtier.transport import client_transport

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
WORKER_TIMEOUT_S = 5.0
TASK_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 30.0
INTERRUPTED_WAIT_S = 0.5  # a close cut short by Ctrl-C: workers get SIGTERM after this
POLL_INTERVAL_S = 0.05
HELLO_RESEND_S = 1.0  # until welcomed: a worker that binds late still gets one


@dataclass
class _Pending:
    task: Any
    future: TaskFuture
    deadline: float
    results: dict[int, t.Result] = field(default_factory=dict)
    expected: set[int] | None = None  # positions that must answer (None: all)


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
        self._curve = (
            CurveKeys.from_secret(auth_key)
            if auth_key
            else CurveKeys.from_file(auth_key_file)
            if auth_key_file
            else None
        )
        self._observer = observer
        self.task_timeout_s = task_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        procs = list(processes) if processes is not None else [None] * len(endpoints)
        self._ranks = [Rank(i, e, process=p) for i, (e, p) in enumerate(zip(endpoints, procs))]
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._launch: Launch | None = None
        self._closing = False
        self._ping: tuple[threading.Event, set[int]] | None = None
        self._ready = threading.Condition()  # notified when a rank is welcomed or lost
        self.client_id = uuid.uuid4().hex[:12]

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
        **worker_settings: Any,
    ) -> Client:
        """Start one ``kvtier serve`` process per rank and wait until all are ready.

        ``ranks`` starts only those ranks of ``world_size`` (the process that owns TP rank r
        launches rank r). ``worker_settings`` are WorkerConfig fields shared by every rank
        (num_host_blocks, device_cache_mode, namespace, model_dir, engine_timeout_s,
        metrics_port: each rank serves on metrics_port + rank, ...); each rank's device cache is
        named ``kvtier-{instance_id}-rank{r}-dev0`` unless ``device_cache`` names it.
        ``client_options`` are Client options. The workers' logs go to ``log_dir`` (default:
        the private launch directory, removed by ``close``); a failed start raises WorkerError
        with the tail of every log.
        """
        instance_id = instance_id or uuid.uuid4().hex[:10]
        worker_settings.setdefault("start_timeout_s", start_timeout_s)  # its wait for a hello
        configs = worker_configs(spec, world_size, storage, instance_id, ranks, worker_settings)
        launch = start_workers(configs, log_dir)
        return cls.from_launch(launch, start_timeout_s, **(client_options or {}))

    @classmethod
    def from_launch(
        cls, launch: Launch, start_timeout_s: float = START_TIMEOUT_S, **options: Any
    ) -> Client:
        """A client for workers ``kvtier.launcher.start_workers`` started (they may still be
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
        self.transport = client_transport([r.endpoint for r in self._ranks], self._curve)
        self.transport.open()
        self._thread = threading.Thread(target=self._loop, name="kvtier-client", daemon=True)
        self._thread.start()
        with self._ready:
            settled = self._ready.wait_for(
                lambda: all(r.welcomed for r in self._ranks) or any(r.lost for r in self._ranks),
                start_timeout_s,
            )
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
        task = msgspec.structs.replace(task, task_id=next(self._ids))
        future = TaskFuture()
        deadline = time.monotonic() + (timeout_s or self.task_timeout_s)
        with self._lock:
            lost = [r for r in self._ranks if r.lost]
            if lost or self._thread is None:
                why = f"rank {lost[0].position}: {lost[0].lost}" if lost else "client is closed"
                future.set_exception(WorkerLost(why))
                return future
            self._pending[task.task_id] = _Pending(task, future, deadline)
        self._send_all(task)
        return future

    def _call(self, task: Any, timeout_s: float | None) -> t.Result:
        return self.submit(task, timeout_s).result()

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
        return self._call(t.Lookup(block_hashes=list(block_hashes)), timeout_s).count

    def control(self, method: str, timeout_s: float | None = None, **args: Any) -> ControlAnswer:
        """pause, resume, update_weights [version=...], sleep, wakeup or stats, on every rank."""
        future = self.submit(t.Control(method=method, args=args), timeout_s)
        result: t.Result = future.result()
        return ControlAnswer(result.code, result.message, future.per_rank)

    def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip of a heartbeat to every rank (the raw transport latency), in seconds."""
        event, start = threading.Event(), time.perf_counter()
        with self._lock:
            self._ping = (event, set(range(self.world_size)))
        self._send_all(t.Heartbeat(sent_at=time.time()))
        if not event.wait(timeout_s):
            raise TaskTimeout("ping not answered")
        return time.perf_counter() - start

    # ---- the I/O thread ---------------------------------------------------------------------

    def _send_all(self, message: Any) -> None:
        self._outbox.put(t.encode(message))
        self.transport.wake()

    def _loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            received = self.transport.receive(POLL_INTERVAL_S)
            self._flush_outbox()
            for position, payload in received:
                self._receive(self._ranks[position], payload)
            now = time.monotonic()
            if now >= next_beat:
                beat = t.encode(t.Heartbeat(sent_at=time.time()))
                for r in self._ranks:
                    if r.welcomed and not r.lost:
                        self.transport.send(r.position, beat)
                next_beat = now + self.heartbeat_interval_s
            self._say_hello(now)
            self._check_health(now)

    def _say_hello(self, now: float) -> None:
        hello = None
        for r in self._ranks:
            if not r.welcomed and not r.lost and now - r.last_hello >= HELLO_RESEND_S:
                hello = hello or t.encode(
                    t.Hello(
                        protocol_version=t.PROTOCOL_VERSION,
                        client_id=self.client_id,
                        observer=self._observer,
                    )
                )
                self.transport.send(r.position, hello)
                r.last_hello = now

    def _flush_outbox(self) -> None:
        while True:
            try:
                payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            for r in self._ranks:
                if not r.lost:
                    self.transport.send(r.position, payload)

    def _receive(self, r: Rank, payload: bytes) -> None:
        try:
            message = t.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("client: rank %d sent a malformed message: %s", r.position, str(e)[:200])
            return
        r.last_heard = time.monotonic()
        if isinstance(message, t.Result):
            self._on_result(r, message)
        elif isinstance(message, t.Welcome):
            with self._ready:
                if message.accepted:
                    r.welcomed = True
                else:
                    r.lost, r.lost_error = message.message, ProtocolMismatch
                self._ready.notify_all()
        elif isinstance(message, t.Heartbeat):
            self._on_heartbeat(r)

    def _on_heartbeat(self, r: Rank) -> None:
        ping = self._ping
        if ping is not None:
            event, waiting = ping
            waiting.discard(r.position)
            if not waiting:
                event.set()

    def _on_result(self, r: Rank, result: t.Result) -> None:
        with self._lock:
            pending = self._pending.get(result.task_id)
            if pending is None:
                return  # answered already (timed out, or a worker was lost)
            pending.results[r.position] = result
            expected = pending.expected or range(self.world_size)
            if any(p not in pending.results for p in expected):
                return
            del self._pending[result.task_id]
        pending.future.per_rank = dict(pending.results)
        pending.future.set_result(aggregate(pending.task, pending.results))

    def _check_health(self, now: float) -> None:
        for r in self._ranks:
            loss = r.check(now, self.transport.failed_handshakes(r.position), self.worker_timeout_s)
            if loss is not None:
                self._lose(r, *loss)
        with self._lock:
            expired = [p for p in self._pending.values() if now > p.deadline]
            for p in expired:
                del self._pending[p.task.task_id]
        for p in expired:
            missing = sorted(set(p.expected or range(self.world_size)) - set(p.results))
            p.future.set_exception(
                TaskTimeout(
                    f"task {p.task.task_id} ({t.task_name(p.task)}): ranks {missing} "
                    "did not answer in time"
                )
            )

    def _lose(self, r: Rank, why: str, error: type[WorkerError] = WorkerError) -> None:
        """Mark a rank lost and fail every task that waits for it (also while closing)."""
        with self._ready:
            r.lost, r.lost_error = why, error
            self._ready.notify_all()
        if not r.welcomed:
            return  # start() reports it, with the worker's log
        if not self._closing:
            log.error("client: rank %d lost: %s", r.position, why)
        with self._lock:
            failed = [
                p for p in self._pending.values() if r.position in (p.expected or [r.position])
            ]
            for p in failed:
                del self._pending[p.task.task_id]
        for p in failed:
            p.future.set_exception(
                WorkerLost(
                    f"rank {r.position}: {why} (task {p.task.task_id} {t.task_name(p.task)})"
                )
            )

    # ---- shutdown ---------------------------------------------------------------------------

    def close(
        self, timeout_s: float = CLOSE_TIMEOUT_S, shutdown_workers: bool | None = None
    ) -> None:
        """Stop. Workers this client launched are shut down cleanly (they answer what they
        hold); workers it only connected to are left running unless ``shutdown_workers``.
        Never waits for a worker that is gone or never started: those are ended at once."""
        if self._thread is None:
            return
        if shutdown_workers is None:
            shutdown_workers = any(r.process is not None for r in self._ranks)
        self._closing = True
        interrupted = True
        try:
            if shutdown_workers:
                self._shut_down_workers(timeout_s)
            interrupted = False
        finally:
            with deferred_interrupts():  # what the workers leave is removed whatever comes
                self._release(INTERRUPTED_WAIT_S if interrupted else timeout_s)

    def _release(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._end_processes(timeout_s)
            self._stop.set()
            self._thread.join(5)
            self._thread = None
            with self._lock:
                leftover = list(self._pending.values())
                self._pending.clear()
            for p in leftover:
                p.future.set_exception(WorkerLost("client closed"))
            self.transport.close()
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
        with self._lock:
            self._pending[task.task_id] = _Pending(
                task, future, time.monotonic() + timeout_s, expected=live
            )
        self._send_all(task)
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


__all__ = ["Client", "ControlAnswer", "TaskFuture", "aggregate"]
