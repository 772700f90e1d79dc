"""Client: the engine's side. Fans each task out to every rank and gathers one answer.

One I/O thread owns the sockets (a DEALER per worker): it sends tasks and heartbeats, receives
results, and watches the workers. A task's future resolves when every rank has answered:
blocks are the shortest prefix over ranks, the status the worst. It fails with ``WorkerLost``
when a rank's process exits or its heartbeats stop for ``worker_timeout_s``, and with
``TaskTimeout`` after ``task_timeout_s`` — never a hang.
"""

from __future__ import annotations

import itertools
import logging
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
import zmq

from kvtier import tasks as t
from kvtier.config import ENGINE_TIMEOUT_S, WorkerConfig
from kvtier.errors import ProtocolMismatch, TaskTimeout, WorkerError, WorkerLost
from kvtier.spec import KVCacheSpec
from kvtier.transport import ThreadLocalPush, configure

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
WORKER_TIMEOUT_S = 5.0
TASK_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
POLL_INTERVAL_MS = 50
EXIT_GRACE_S = 0.2  # after a worker process exits, its last answers are still read this long


@dataclass
class _Rank:
    rank: int
    endpoint: str
    socket: zmq.Socket | None = None
    process: subprocess.Popen | None = None
    last_heard: float = 0.0
    welcomed: bool = False
    lost: str = ""
    exited_at: float = 0.0


@dataclass
class _Pending:
    task: Any
    future: Future
    deadline: float
    results: dict[int, t.Result] = field(default_factory=dict)
    expected: set[int] | None = None  # ranks that must answer (None: all)


@dataclass(frozen=True)
class ControlAnswer:
    """A control request's answer over all ranks: the worst code, and each rank's answer."""

    code: int
    message: str
    per_rank: dict[int, t.Result]


class Client:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        processes: Sequence[subprocess.Popen] | None = None,
        task_timeout_s: float = TASK_TIMEOUT_S,
        worker_timeout_s: float = WORKER_TIMEOUT_S,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        cleanup_paths: Sequence[Path] = (),
    ) -> None:
        self.task_timeout_s = task_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        procs = list(processes or [None] * len(endpoints))
        self._ranks = [_Rank(r, e, process=p) for r, (e, p) in enumerate(zip(endpoints, procs))]
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cleanup_paths = list(cleanup_paths)
        self._closing = False
        self.client_id = uuid.uuid4().hex[:12]

    @property
    def world_size(self) -> int:
        return len(self._ranks)

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def connect(
        cls, endpoints: Sequence[str], start_timeout_s: float = START_TIMEOUT_S, **options: Any
    ) -> Client:
        """Talk to workers that are already running."""
        return cls(endpoints, **options).start(start_timeout_s)

    @classmethod
    def launch(
        cls,
        spec: KVCacheSpec,
        world_size: int = 1,
        storage: dict[str, Any] | None = None,
        *,
        instance_id: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        log_dir: str | Path | None = None,
        client_options: dict[str, Any] | None = None,
        **worker_settings: Any,
    ) -> Client:
        """Start one ``kvtier serve`` process per rank and wait until all are ready.

        ``worker_settings`` are WorkerConfig fields shared by every rank (num_host_blocks,
        device_cache_mode, namespace, model_dir, engine_timeout_s, ...); each rank's device cache
        is named ``kvtier-{instance_id}-rank{r}-dev0`` unless ``device_cache`` templates it.
        """
        instance_id = instance_id or uuid.uuid4().hex[:10]
        worker_settings.setdefault("engine_timeout_s", ENGINE_TIMEOUT_S)
        configs = [
            WorkerConfig.from_dict(
                {
                    "spec": spec,
                    "instance_id": instance_id,
                    "rank": rank,
                    "world_size": world_size,
                    "storage": storage or {"backend": "file"},
                    **worker_settings,
                }
            )
            for rank in range(world_size)
        ]
        config_dir = Path(tempfile.mkdtemp(prefix=f"kvtier-{instance_id}-"))
        processes: list[subprocess.Popen] = []
        log_paths: list[Path] = []
        try:
            for cfg in configs:
                path = config_dir / f"rank{cfg.rank}.yaml"
                path.write_text(yaml.safe_dump(cfg.to_dict()))
                log_path = Path(log_dir or config_dir) / f"rank{cfg.rank}.log"
                with open(log_path, "ab") as out:
                    processes.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(path)],
                            stdout=out,
                            stderr=out,
                            stdin=subprocess.DEVNULL,
                        )
                    )
                log_paths.append(log_path)
            client = cls(
                [c.endpoint_address for c in configs],
                processes=processes,
                **(client_options or {}),
            )
            client.start(start_timeout_s)
            client._cleanup_paths.append(config_dir)  # removed by close(), logs included
            return client
        except WorkerError as e:
            for p in processes:
                p.kill()
                p.wait()
            tails = [f"--- {p.name} ---\n{_tail(p)}" for p in log_paths if p.exists()]
            _remove_tree(config_dir)
            raise WorkerError(f"{e}\n" + "\n".join(tails)) from None
        except BaseException:
            for p in processes:
                p.kill()
                p.wait()
            _remove_tree(config_dir)
            raise

    def start(self, start_timeout_s: float = START_TIMEOUT_S) -> Client:
        self.context = zmq.Context()
        self._wake_address = f"inproc://kvtier-client-{self.client_id}"
        self._wake = self.context.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._wake_push = ThreadLocalPush(self.context, self._wake_address)
        now = time.monotonic()
        for r in self._ranks:
            r.socket = configure(self.context.socket(zmq.DEALER))
            r.socket.connect(r.endpoint)
            r.last_heard = now
        self._thread = threading.Thread(target=self._loop, name="kvtier-client", daemon=True)
        self._thread.start()
        self._send_all(t.Hello(t.PROTOCOL_VERSION, self.client_id))
        deadline = time.monotonic() + start_timeout_s
        while not all(r.welcomed for r in self._ranks):
            failed = [r for r in self._ranks if r.lost]
            if failed:
                self.close()
                r = failed[0]
                if "protocol" in r.lost:
                    raise ProtocolMismatch(f"rank {r.rank}: {r.lost}")
                raise WorkerError(f"rank {r.rank} did not start: {r.lost}")
            if time.monotonic() > deadline:
                self.close()
                missing = [r.rank for r in self._ranks if not r.welcomed]
                raise WorkerError(f"ranks {missing} not ready after {start_timeout_s:.0f} s")
            time.sleep(0.01)
        log.info("client %s: %d ranks ready", self.client_id, self.world_size)
        return self

    # ---- tasks ------------------------------------------------------------------------------

    def submit(self, task: Any, timeout_s: float | None = None) -> Future:
        """Send ``task`` (its task_id is replaced by a fresh one) to every rank."""
        task = msgspec.structs.replace(task, task_id=next(self._ids))
        future: Future = Future()
        deadline = time.monotonic() + (timeout_s or self.task_timeout_s)
        with self._lock:
            lost = [r for r in self._ranks if r.lost]
            if lost:
                future.set_exception(WorkerLost(f"rank {lost[0].rank}: {lost[0].lost}"))
                return future
            self._pending[task.task_id] = _Pending(task, future, deadline)
        self._send_all(task)
        return future

    def _call(self, task: Any, timeout_s: float | None) -> t.Result:
        return self.submit(task, timeout_s).result()

    def swap_out(self, device_block_ids, host_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.SwapOut(0, _ids(device_block_ids), _ids(host_block_ids)), timeout_s)

    def swap_in(self, host_block_ids, device_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.SwapIn(0, _ids(host_block_ids), _ids(device_block_ids)), timeout_s)

    def save(self, block_hashes, device_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.Save(0, list(block_hashes), _ids(device_block_ids)), timeout_s)

    def load(self, block_hashes, device_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.Load(0, list(block_hashes), _ids(device_block_ids)), timeout_s)

    def save_host(self, block_hashes, host_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.SaveHost(0, list(block_hashes), _ids(host_block_ids)), timeout_s)

    def load_host(self, block_hashes, host_block_ids, timeout_s=None) -> t.Result:
        return self._call(t.LoadHost(0, list(block_hashes), _ids(host_block_ids)), timeout_s)

    def lookup(self, block_hashes, timeout_s=None) -> int:
        return self._call(t.Lookup(0, list(block_hashes)), timeout_s).count

    def control(self, method: str, timeout_s: float | None = None, **args: Any) -> ControlAnswer:
        future = self.submit(t.Control(0, method, args), timeout_s)
        return future.result().data["control"]

    def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip of a heartbeat to every rank (the raw transport latency), in seconds."""
        event, start = threading.Event(), time.perf_counter()
        with self._lock:
            self._ping = (event, set(range(self.world_size)))
        self._send_all(t.Heartbeat(time.time()))
        if not event.wait(timeout_s):
            raise TaskTimeout("ping not answered")
        return time.perf_counter() - start

    # ---- the I/O thread ---------------------------------------------------------------------

    def _send_all(self, message: Any) -> None:
        self._outbox.put(t.encode(message))
        self._wake_push.send([b""])

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        by_socket = {}
        for r in self._ranks:
            poller.register(r.socket, zmq.POLLIN)
            by_socket[r.socket] = r
        next_beat = time.monotonic()
        while not self._stop.is_set():
            exiting = any(r.exited_at and not r.lost for r in self._ranks)
            events = dict(poller.poll(10 if exiting else POLL_INTERVAL_MS))
            if self._wake in events:
                _drain(self._wake)
                self._flush_outbox()
            for sock in events:
                if sock is not self._wake:
                    self._receive(by_socket[sock])
            now = time.monotonic()
            if now >= next_beat:
                beat = t.encode(t.Heartbeat(time.time()))
                for r in self._ranks:
                    if not r.lost:
                        r.socket.send(beat)
                next_beat = now + self.heartbeat_interval_s
            self._check_health(now)

    def _flush_outbox(self) -> None:
        while True:
            try:
                payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            for r in self._ranks:
                if not r.lost:
                    r.socket.send(payload)

    def _receive(self, r: _Rank) -> None:
        while True:
            try:
                payload = r.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            r.last_heard = time.monotonic()
            try:
                message = t.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("client: rank %d sent a malformed message: %s", r.rank, e)
                continue
            if isinstance(message, t.Result):
                self._on_result(r, message)
            elif isinstance(message, t.Welcome):
                if message.accepted:
                    r.welcomed = True
                else:
                    r.lost = message.message
            elif isinstance(message, t.Heartbeat):
                self._on_heartbeat(r)

    def _on_heartbeat(self, r: _Rank) -> None:
        ping = getattr(self, "_ping", None)
        if ping is not None:
            event, waiting = ping
            waiting.discard(r.rank)
            if not waiting:
                event.set()

    def _on_result(self, r: _Rank, result: t.Result) -> None:
        with self._lock:
            pending = self._pending.get(result.task_id)
            if pending is None:
                return  # answered already (timed out, or a worker was lost)
            pending.results[r.rank] = result
            expected = pending.expected or range(self.world_size)
            if any(rank not in pending.results for rank in expected):
                return
            del self._pending[result.task_id]
        pending.future.set_result(aggregate(pending.task, pending.results))

    def _check_health(self, now: float) -> None:
        for r in self._ranks:
            if r.lost:
                continue
            code = r.process.poll() if r.process is not None else None
            if code is not None:
                # Its last answers may still be in flight: read them before giving up on it.
                r.exited_at = r.exited_at or now
                if now - r.exited_at >= EXIT_GRACE_S:
                    self._lose(r, f"worker process exited with code {code}")
            elif now - r.last_heard > self.worker_timeout_s:
                self._lose(
                    r,
                    f"no answer for {now - r.last_heard:.1f} s "
                    f"(worker_timeout_s={self.worker_timeout_s})",
                )
        expired = []
        with self._lock:
            for task_id, pending in list(self._pending.items()):
                if now > pending.deadline:
                    expired.append(self._pending.pop(task_id))
        for pending in expired:
            missing = sorted(set(range(self.world_size)) - set(pending.results))
            pending.future.set_exception(
                TaskTimeout(
                    f"task {pending.task.task_id} ({t.task_name(pending.task)}): ranks {missing} "
                    "did not answer in time"
                )
            )

    def _lose(self, r: _Rank, why: str) -> None:
        r.lost = why
        if not r.welcomed or self._closing:
            return
        log.error("client: rank %d lost: %s", r.rank, why)
        with self._lock:
            failed = list(self._pending.values())
            self._pending.clear()
        for pending in failed:
            pending.future.set_exception(
                WorkerLost(
                    f"rank {r.rank}: {why} "
                    f"(task {pending.task.task_id} {t.task_name(pending.task)})"
                )
            )

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0, shutdown_workers: bool | None = None) -> None:
        """Stop. Workers this client launched are shut down cleanly (they answer what they
        hold); workers it only connected to are left running unless ``shutdown_workers``."""
        if self._thread is None:
            return
        if shutdown_workers is None:
            shutdown_workers = any(r.process is not None for r in self._ranks)
        live = [
            r
            for r in self._ranks
            if shutdown_workers
            and not r.lost
            and r.welcomed
            and (r.process is None or r.process.poll() is None)
        ]
        self._closing = True
        if live:
            task = t.Shutdown(next(self._ids))
            future: Future = Future()
            with self._lock:
                self._pending[task.task_id] = _Pending(
                    task, future, time.monotonic() + timeout_s, expected={r.rank for r in live}
                )
            self._send_all(task)
            try:
                future.result(timeout_s + 1)
            except Exception as e:  # a lost or slow worker: its process is ended below
                log.warning("client: shutdown was not answered by every rank: %s", e)
        deadline = time.monotonic() + timeout_s
        for r in self._ranks:
            if r.process is not None:
                try:
                    r.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("client: rank %d did not exit; terminating it", r.rank)
                    r.process.terminate()
                    try:
                        r.process.wait(5)
                    except subprocess.TimeoutExpired:
                        r.process.kill()
                        r.process.wait()
        self._stop.set()
        self._thread.join(5)
        self._thread = None
        with self._lock:
            leftover = list(self._pending.values())
            self._pending.clear()
        for pending in leftover:
            pending.future.set_exception(WorkerLost("client closed"))
        self._wake_push.close()
        for r in self._ranks:
            r.socket.close(linger=0)
            if r.process is not None and r.endpoint.startswith("ipc://"):
                # A worker that was killed could not unlink its socket: its launcher does.
                Path(r.endpoint[len("ipc://") :]).unlink(missing_ok=True)
        self._wake.close(linger=0)
        self.context.term()
        for path in self._cleanup_paths:
            _remove_tree(path)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks if r.process is not None]


def aggregate(task: Any, results: dict[int, t.Result]) -> t.Result:
    """One answer from every rank's: shortest prefix of blocks, worst status, summed bytes."""
    ordered = [results[r] for r in sorted(results)]
    worst = max(ordered, key=lambda res: t.STATUS_ORDER[res.status])
    shortest = min((res.blocks for res in ordered), key=len)
    messages = [f"rank {res.rank}: {res.message}" for res in ordered if res.message]
    data: dict[str, Any] = {}
    if isinstance(task, t.Control):
        code = max(res.code for res in ordered)
        data["control"] = ControlAnswer(code, "; ".join(messages), dict(enumerate(ordered)))
    return t.Result(
        task.task_id,
        worst.status,
        list(shortest),
        min(res.count for res in ordered),
        sum(res.bytes_moved for res in ordered),
        max(res.seconds for res in ordered),
        "; ".join(messages),
        max((res.code for res in ordered), default=0),
        -1,
        data,
    )


def _ids(ids: Any) -> list[int]:
    return [int(i) for i in ids]


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


__all__ = ["Client", "ControlAnswer", "aggregate"]
