"""Worker: one per tensor-parallel rank; answers every task it receives exactly once.

Threads and their jobs:
- the loop thread owns the sockets: it decodes messages, answers hello and heartbeats, admits
  data tasks through the Gate, forwards results, and watches the engine (``engine_timeout_s``);
- one single-thread executor per direction (swap_out, swap_in, save, load, host_io, lookup), so a
  slow storage write never delays a swap-in; FIFO within a direction;
- one control thread for pause / resume / update_weights / sleep / wakeup / stats.
Executors hand results to the loop over per-thread inproc sockets.

``Worker(config).start()`` runs it in this process (a library object); ``serve()`` runs the loop
in the calling thread and returns the process exit code (``kvtier serve``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from kvtier import tasks as t
from kvtier.config import WorkerConfig
from kvtier.control import Gate, Refusal, WorkerState
from kvtier.datapath import DataPath, Outcome
from kvtier.device import DeviceCache
from kvtier.errors import KvtierError
from kvtier.host import HostPool
from kvtier.keys import KeyScheme, read_weight_version
from kvtier.storage import make_backend
from kvtier.transport import ThreadLocalPush, configure

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_LOST = 3
POLL_INTERVAL_MS = 100
DRAIN_TIMEOUT_S = 60.0  # pause/sleep wait this long for in-flight tasks
# Swaps this small run on the loop thread when their direction is idle (microseconds of copying).
INLINE_MAX_BLOCKS = 4
INLINE_DIRECTIONS = (t.Direction.SWAP_OUT, t.Direction.SWAP_IN)
QUIET_DIRECTIONS = (t.Direction.SWAP_OUT, t.Direction.SWAP_IN, t.Direction.LOOKUP)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.gate = Gate()
        self.exit_code: int | None = None
        self._stop = threading.Event()
        self._shutdown_identity: bytes | None = None
        self._shutdown_task_id = 0
        self._last_heard = time.monotonic()
        self._counters: dict[str, Counter] = defaultdict(Counter)
        self._errors: Counter = Counter()
        self._counter_lock = threading.Lock()
        self._pending: dict[Future, tuple[bytes, Any]] = {}
        self._busy: Counter = Counter()  # per direction: submitted, not finished
        self._inline: list[tuple[bytes, Any]] = []
        self._loop_ident = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = False
        self.metrics = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, background: bool = True) -> Worker:
        """Build the data path and bind the socket; with ``background`` run the loop thread."""
        cfg = self.config
        if cfg.device_cache_mode == "create":
            self.device_cache = DeviceCache.create(cfg.spec, cfg.device_cache_name, cfg.device)
        else:
            self.device_cache = DeviceCache.attach(cfg.spec, cfg.device_cache_name)
        try:
            self.host_pool = HostPool(cfg.spec, cfg.num_host_blocks + 2 * cfg.staging_blocks)
            self.storage = make_backend(cfg.spec, cfg.storage)
        except BaseException:
            self.device_cache.close()
            raise
        version = cfg.version if cfg.version is not None else read_weight_version(cfg.model_dir)
        keys = KeyScheme(cfg.namespace, cfg.spec.fingerprint, cfg.rank, version)
        self.datapath = DataPath(
            self.device_cache,
            self.host_pool,
            cfg.num_host_blocks,
            cfg.staging_blocks,
            self.storage,
            keys,
        )
        self.executors = {
            d: ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{d.value}") for d in t.Direction
        }
        self.control_executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-control")
        self.context = zmq.Context()
        self.router = configure(self.context.socket(zmq.ROUTER))
        self.router.bind(cfg.endpoint_address)
        self._results_address = f"inproc://kvtier-results-{uuid.uuid4().hex}"
        self.results = self.context.socket(zmq.PULL)
        self.results.bind(self._results_address)
        self.push = ThreadLocalPush(self.context, self._results_address)
        self.metrics = None
        if cfg.metrics_port is not None:
            from kvtier.metrics import WorkerMetrics

            self.metrics = WorkerMetrics(cfg.rank, self.stats)
            self.metrics_port = self.metrics.serve(cfg.metrics_port)
            log.info(
                "rank %d: metrics on http://127.0.0.1:%d/metrics", self.rank, self.metrics_port
            )
        self._started = True
        self._last_heard = time.monotonic()
        log.info(
            "rank %d: serving %s (device cache %s, %d host blocks, storage %s)",
            self.rank,
            cfg.endpoint_address,
            cfg.device_cache_name,
            cfg.num_host_blocks,
            self.storage.kind,
        )
        if background:
            self._thread = threading.Thread(
                target=self._loop, name=f"kvtier-worker-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def serve(self) -> int:
        """Run until shutdown, SIGTERM or engine loss; return the exit code."""
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        self.start(background=False)
        self._loop()
        return self.exit_code or EXIT_OK

    def request_stop(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float = 30.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        self._loop_ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                if self.results in events:
                    self._forward_results()
                if self.router in events:
                    self._receive()
                silent = time.monotonic() - self._last_heard
                if silent > self.config.engine_timeout_s:
                    log.error(
                        "rank %d: nothing from the engine for %.1f s (engine_timeout_s="
                        "%.1f): exiting",
                        self.rank,
                        silent,
                        self.config.engine_timeout_s,
                    )
                    self.exit_code = EXIT_ENGINE_LOST
                    break
        finally:
            self._shutdown()

    def _receive(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            if len(frames) < 2:
                continue
            self._handle(frames[0], frames[-1])

    def _forward_results(self) -> None:
        while True:
            try:
                frames = self.results.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.router.send_multipart(frames)

    def _reply(self, identity: bytes, message: t.Message) -> None:
        """From any thread."""
        self.push.send([identity, t.encode(message)])

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            message = t.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._malformed(identity, payload, e)
            return
        if isinstance(message, t.DATA_TASKS):
            refusal = self.gate.admit((identity, message), self._submit)
            self._run_inline()
            if refusal is not None:
                stopping = refusal is Refusal.STOPPING
                status = t.Status.CANCELLED if stopping else t.Status.ERROR
                self._answer(identity, message.task_id, status, refusal.value)
        elif isinstance(message, t.Heartbeat):
            self.router.send_multipart([identity, t.encode(t.Heartbeat(time.time()))])
        elif isinstance(message, t.Control):
            self.control_executor.submit(self._control, identity, message)
        elif isinstance(message, t.Hello):
            self._hello(identity, message)
        elif isinstance(message, t.Shutdown):
            log.info("rank %d: shutdown requested by the engine", self.rank)
            self._shutdown_identity, self._shutdown_task_id = identity, message.task_id
            self._stop.set()
        else:
            log.warning(
                "rank %d: dropped an unexpected %s message", self.rank, type(message).__name__
            )

    def _malformed(self, identity: bytes, payload: bytes, error: Exception) -> None:
        """Answer with an error when a task id can be read; otherwise log and drop."""
        self._count_error("malformed")
        task_id = None
        try:
            raw = msgspec.msgpack.decode(payload)
            if isinstance(raw, dict) and type(raw.get("task_id")) is int:
                task_id = raw["task_id"]
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
            pass
        if task_id is None:
            log.warning(
                "rank %d: dropped %d bytes that are not a kvtier message: %s",
                self.rank,
                len(payload),
                error,
            )
            return
        log.warning("rank %d: task %d is malformed: %s", self.rank, task_id, error)
        self._answer(identity, task_id, t.Status.ERROR, f"malformed task: {error}")

    def _hello(self, identity: bytes, hello: t.Hello) -> None:
        accepted = hello.protocol_version == t.PROTOCOL_VERSION
        message = (
            ""
            if accepted
            else (
                f"protocol version {hello.protocol_version} is not supported; this worker speaks "
                f"{t.PROTOCOL_VERSION}: upgrade kvtier on both sides"
            )
        )
        if not accepted:
            log.warning("rank %d: refused client %s: %s", self.rank, hello.client_id, message)
        self.router.send_multipart(
            [
                identity,
                t.encode(
                    t.Welcome(
                        t.PROTOCOL_VERSION,
                        self.rank,
                        self.config.world_size,
                        accepted,
                        message,
                        os.getpid(),
                    )
                ),
            ]
        )

    # ---- data tasks -------------------------------------------------------------------------

    def _submit(self, item: tuple[bytes, Any]) -> None:
        """Called under the gate's lock.

        Fast path: a small swap whose direction is idle runs on the loop thread right after
        admission (no thread hand-off either way; FIFO holds because nothing is queued ahead).
        """
        identity, task = item
        direction = t.DIRECTIONS[type(task)]
        with self._pending_lock:
            busy = self._busy[direction]
            self._busy[direction] += 1
        if (
            not busy
            and direction in INLINE_DIRECTIONS
            and threading.get_ident() == self._loop_ident
            and len(task.device_block_ids) <= INLINE_MAX_BLOCKS
        ):
            self._inline.append(item)
            return
        future = self.executors[direction].submit(self._run, identity, task)
        with self._pending_lock:
            self._pending[future] = item
        future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.pop(future, None)

    def _run_inline(self) -> None:
        while self._inline:
            identity, task = self._inline.pop(0)
            self._run(identity, task, inline=True)

    def _run(self, identity: bytes, task: Any, inline: bool = False) -> None:
        start = time.perf_counter()
        try:
            outcome = self.datapath.run(task)
        except KvtierError as e:
            self._count_error(type(e).__name__)
            outcome = Outcome(t.Status.ERROR, message=f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: answered, logged with its traceback, worker goes on
            log.exception("rank %d: task %d failed", self.rank, task.task_id)
            self._count_error("internal")
            outcome = Outcome(t.Status.ERROR, message=f"internal error: {type(e).__name__}: {e}")
        finally:
            with self._pending_lock:
                self._busy[t.DIRECTIONS[type(task)]] -= 1
            self.gate.done()
        seconds = time.perf_counter() - start
        kind = t.task_name(task)
        direction = t.DIRECTIONS[type(task)]
        if self.metrics is not None:
            self.metrics.task(kind, outcome.status.value, outcome.bytes_moved, seconds)
        with self._counter_lock:
            c = self._counters[kind]
            c["tasks"] += 1
            c["bytes"] += outcome.bytes_moved
            c["microseconds"] += int(seconds * 1e6)
            c[outcome.status.value] += 1
        # Storage transfers are logged like the old system did (block count, elapsed time);
        # swaps and lookups, thousands a second, only at DEBUG. Numbers go to stats().
        level = logging.DEBUG if direction in QUIET_DIRECTIONS else logging.INFO
        log.log(
            level,
            "rank %d: %s %d -> %s, %d blocks, %d bytes in %.3f ms",
            self.rank,
            kind,
            task.task_id,
            outcome.status.value,
            len(outcome.blocks),
            outcome.bytes_moved,
            seconds * 1e3,
        )
        result = t.Result(
            task.task_id,
            outcome.status,
            outcome.blocks,
            outcome.count,
            outcome.bytes_moved,
            seconds,
            outcome.message,
            rank=self.rank,
        )
        if inline:
            self.router.send_multipart([identity, t.encode(result)])
        else:
            self._reply(identity, result)

    def _answer(
        self, identity: bytes, task_id: int, status: t.Status, message: str, **extra: Any
    ) -> None:
        self._reply(identity, t.Result(task_id, status, message=message, rank=self.rank, **extra))

    def _count_error(self, kind: str) -> None:
        with self._counter_lock:
            self._errors[kind] += 1
        if self.metrics is not None:
            self.metrics.error(kind)

    # ---- control ----------------------------------------------------------------------------

    def _control(self, identity: bytes, task: t.Control) -> None:
        from kvtier import worker_control

        try:
            code, message, data = worker_control.handle(self, task.method, dict(task.args))
        except Exception as e:
            log.exception("rank %d: control %s failed", self.rank, task.method)
            code, message, data = (
                t.Code.FAILED,
                f"{task.method} failed: {type(e).__name__}: {e}",
                {},
            )
        status = t.Status.OK if code == t.Code.OK else t.Status.ERROR
        log.info("rank %d: control %s -> %d %s", self.rank, task.method, code, message)
        self._answer(identity, task.task_id, status, message, code=code, data=data)

    def stats(self) -> dict[str, Any]:
        with self._counter_lock:
            per_kind = {k: dict(v) for k, v in self._counters.items()}
            errors = dict(self._errors)
        return {
            "rank": self.rank,
            "state": self.gate.state.value,
            "in_flight": self.gate.in_flight,
            "held": self.gate.held,
            "queue_depths": {d.value: ex._work_queue.qsize() for d, ex in self.executors.items()},
            "tasks": per_kind,
            "errors": errors,
            "storage": self.storage.stats.as_dict(),
            "storage_usage": vars(self.storage.usage()) if hasattr(self.storage, "usage") else {},
            "weight_version": self.datapath.keys.version,
        }

    # ---- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Answer everything still pending, release what this worker holds."""
        if not self._started:
            return
        self.gate.set_state(WorkerState.STOPPING)
        for identity, task in self.gate.take_held():
            self._answer(identity, task.task_id, t.Status.CANCELLED, "worker is shutting down")
        with self._pending_lock:
            queued = dict(self._pending)  # cancelled futures leave _pending as they cancel
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        cancelled = [(f, item) for f, item in queued.items() if f.cancelled()]
        for _, (identity, task) in cancelled:
            self._answer(
                identity, task.task_id, t.Status.CANCELLED, "worker shut down before the task ran"
            )
            self.gate.done()
        for executor in self.executors.values():
            executor.shutdown(wait=True)
        self.control_executor.shutdown(wait=True, cancel_futures=True)
        if self._shutdown_identity is not None:
            self._answer(
                self._shutdown_identity, self._shutdown_task_id, t.Status.OK, "worker stopped"
            )
        self._flush_results()
        self.push.close()
        self.results.close(linger=0)
        self.router.close(linger=1000)
        self.context.term()
        if self.metrics is not None:
            self.metrics.close()
        self._release()
        log.info("rank %d: stopped", self.rank)

    def _flush_results(self) -> None:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not self.results.poll(50):
                break
            self._forward_results()

    def _release(self) -> None:
        self.datapath.close()
        self.storage.close()
        self.host_pool.close()
        self.device_cache.close()
        address = self.config.endpoint_address
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://") :])
            except FileNotFoundError:
                pass
