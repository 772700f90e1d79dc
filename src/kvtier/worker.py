"""Worker: one per tensor-parallel rank; answers every task it receives exactly once.

Threads and their jobs:
- the loop thread owns the transport: it decodes messages, answers hello and heartbeats, stamps
  data tasks with the weight version in force and admits them through the Gate, hands control
  requests to the ControlPlane, and watches the engine (``engine_timeout_s``, and the launching
  process: a worker whose launcher is gone exits at once);
- one single-thread executor per direction (swap_out, swap_in, save, load, host_io, lookup), so a
  slow storage write never delays a swap-in; FIFO within a direction;
- the control thread (ControlPlane) for what control requests may block on.

Only peers whose hello was accepted get tasks run and keep the engine-liveness timer going.

``Worker(config).start()`` runs it in this process (a library object); ``serve()`` runs the loop
in the calling thread and returns the process exit code (``kvtier serve``). SIGTERM and SIGINT
stop it gracefully: in-flight tasks finish, queued and held ones are answered ``cancelled``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from kvtier import shm
from kvtier import tasks as t
from kvtier.auth import CurveKeys
from kvtier.config import WorkerConfig
from kvtier.control_plane import Answer, ControlPlane
from kvtier.datapath import Outcome
from kvtier.endpoint import EndpointClaim
from kvtier.errors import KvtierError
from kvtier.gate import Gate, Refusal, WorkerState
from kvtier.keys import KeyScheme
from kvtier.peers import PeerTable
from kvtier.resources import RankResources
from kvtier.transport import Peer, server_transport
from kvtier.worker_stats import TaskCounters

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_LOST = 3
POLL_INTERVAL_S = 0.1
FLUSH_TIMEOUT_S = 2.0
# Swaps this small run on the loop thread when their direction is idle (microseconds of copying).
INLINE_MAX_BLOCKS = 4
INLINE_DIRECTIONS = (t.Direction.SWAP_OUT, t.Direction.SWAP_IN)
QUIET_DIRECTIONS = (t.Direction.SWAP_OUT, t.Direction.SWAP_IN, t.Direction.LOOKUP)

# Saves are off the engine's critical path: on a machine whose cores the engine keeps busy (vLLM
# on CPU runs OpenMP on every core, and one preempted thread stalls a whole parallel region),
# they run at a lower priority so that they take idle time rather than the engine's.
BACKGROUND_DIRECTIONS = (t.Direction.SAVE,)
BACKGROUND_NICE = 10

Item = tuple[Peer, Any, KeyScheme]  # (peer, data task, the keys it was stamped with)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.gate = Gate(weigh=_weigh)
        self.exit_code: int | None = None
        self.counters = TaskCounters()
        self.metrics: Any = None
        self._stop = threading.Event()
        self._shutdown_request: tuple[Peer, int] | None = None
        self._last_heard = time.monotonic()
        self._greeted = False  # an engine's hello was accepted: silence counts from then
        self.peers = PeerTable(self.rank)
        self._pending: dict[Future, Item] = {}
        self._busy: Counter = Counter()  # per direction: submitted, not finished
        self._inline: list[Item] = []
        self._loop_ident = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = False
        self._started_at = time.time()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, background: bool = True) -> Worker:
        """Build the rank's resources and bind; with ``background`` run the loop thread."""
        cfg = self.config
        curve = (
            CurveKeys.from_file(cfg.auth_key_file)
            if cfg.auth_key_file and cfg.endpoint_address.startswith("tcp://")
            else None
        )
        shm.reclaim_orphans()
        self.claim = EndpointClaim(cfg.endpoint_address).acquire()
        self.resources = RankResources(cfg)
        self.executors = {
            d: ThreadPoolExecutor(
                1,
                thread_name_prefix=f"kvtier-{d.value}",
                initializer=_lower_priority if d in BACKGROUND_DIRECTIONS else None,
            )
            for d in t.Direction
        }
        self.control = ControlPlane(
            self.resources,
            self.gate,
            submit=self._submit,
            reply=self._reply_control,
            cancel=self._cancel_item,
            stats=self.stats,
            rank=self.rank,
        )
        self.transport = server_transport(cfg.endpoint_address, curve, self._handshake_refused)
        try:
            self.resources.open()
            self._start_metrics()
            self.transport.open()
        except BaseException:
            for executor in self.executors.values():
                executor.shutdown(wait=False)
            self.control.close()
            self._release()
            raise
        self._started = True
        self._last_heard = time.monotonic()
        log.info(
            "rank %d: serving %s (device cache %s, %d host blocks, storage %s)",
            self.rank,
            cfg.endpoint_address,
            cfg.device_cache_name,
            cfg.num_host_blocks,
            cfg.storage.get("backend", "file"),
        )
        if background:
            self._thread = threading.Thread(
                target=self._loop, name=f"kvtier-worker-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from kvtier.metrics import WorkerMetrics

        self.metrics = WorkerMetrics(self.rank, self.stats)
        try:
            self.metrics_port = self.metrics.serve(self.config.metrics_port)
        except OSError as e:
            from kvtier.errors import ConfigError

            raise ConfigError(
                "metrics_port", f"cannot serve metrics on 127.0.0.1:{self.config.metrics_port}: {e}"
            ) from None
        log.info("rank %d: metrics on http://127.0.0.1:%d/metrics", self.rank, self.metrics_port)

    def serve(self) -> int:
        """Run until shutdown, SIGTERM / SIGINT or engine loss; return the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())
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
        try:
            while not self._stop.is_set():
                for peer, payload in self.transport.receive(POLL_INTERVAL_S):
                    self._handle(peer, payload)
                    self._run_inline()
                why = self._engine_gone()
                if why:
                    log.error("rank %d: %s: exiting", self.rank, why)
                    self.exit_code = EXIT_ENGINE_LOST
                    break
        finally:
            self._shutdown()

    def _engine_gone(self) -> str:
        silent = time.monotonic() - self._last_heard
        if not self._greeted:  # still starting: the engine may take long to say hello
            if silent > self.config.start_timeout_s:
                return (
                    f"no engine said hello within {silent:.1f} s of serving "
                    f"(start_timeout_s={self.config.start_timeout_s:.1f})"
                )
        elif silent > self.config.engine_timeout_s:
            return (
                f"nothing from the engine for {silent:.1f} s "
                f"(engine_timeout_s={self.config.engine_timeout_s:.1f})"
            )
        parent = self.config.parent_pid
        if parent is not None and os.getppid() != parent:
            return f"the engine process {parent} that launched this worker is gone"
        return ""

    def _handle(self, peer: Peer, payload: bytes) -> None:
        try:
            message = t.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._malformed(peer, payload, e)
            return
        if isinstance(message, t.Hello):
            self._hello(peer, message)
            return
        if not self.peers.accepted(peer):
            self._unintroduced(peer, message)
            return
        if self.peers.observer(peer):
            self._observe(peer, message)
            return
        self._last_heard = time.monotonic()
        if isinstance(message, t.DATA_TASKS):
            item = (peer, message, self.resources.keys)  # stamped with the version in force now
            refusal = self.gate.admit(item, self._submit)
            if refusal is not None:
                stopping = refusal is Refusal.STOPPING
                status = t.Status.CANCELLED if stopping else t.Status.ERROR
                self._answer(peer, message.task_id, status, refusal.value)
        elif isinstance(message, t.Heartbeat):
            self.transport.send(peer, t.encode(t.Heartbeat(sent_at=time.time())))
        elif isinstance(message, t.Control):
            self.control.receive(peer, message)
        elif isinstance(message, t.Shutdown):
            log.info("rank %d: shutdown requested by the engine", self.rank)
            self._shutdown_request = (peer, message.task_id)
            self._stop.set()
        else:
            log.warning(
                "rank %d: dropped an unexpected %s message", self.rank, type(message).__name__
            )

    def _observe(self, peer: Peer, message: t.Message) -> None:
        """An observer (``kvtier status``): stats and heartbeats only, no proof of engine life."""
        if isinstance(message, t.Heartbeat):
            self.transport.send(peer, t.encode(t.Heartbeat(sent_at=time.time())))
        elif isinstance(message, t.Control) and message.method == "stats":
            self.control.receive(peer, message)
        elif (task_id := getattr(message, "task_id", None)) is not None:
            self._answer(peer, task_id, t.Status.ERROR, "an observer may only ask for stats")

    def _unintroduced(self, peer: Peer, message: t.Message) -> None:
        """A message from a peer without an accepted hello: answered with an error, never run."""
        self.counters.error("unauthenticated", self.metrics)
        task_id = getattr(message, "task_id", None)
        if task_id is None:
            return  # a heartbeat or a stray result: not answered, and no proof of life
        refused = self.peers.refused(peer)
        why = "this client's hello was refused" if refused else "say hello first"
        self._answer(
            peer, task_id, t.Status.ERROR, f"{why} (protocol version {t.PROTOCOL_VERSION})"
        )

    def _malformed(self, peer: Peer, payload: bytes, error: Exception) -> None:
        """Answer with an error when a task id can be read; otherwise log and drop."""
        self.counters.error("malformed", self.metrics)
        task_id = t.peek_task_id(payload)
        if task_id is None:
            log.warning(
                "rank %d: dropped %d bytes that are not a kvtier message: %s",
                self.rank,
                len(payload),
                str(error)[:200],
            )
            return
        log.warning("rank %d: task %d is malformed: %s", self.rank, task_id, str(error)[:200])
        self._answer(peer, task_id, t.Status.ERROR, f"malformed task: {str(error)[:200]}")

    def _hello(self, peer: Peer, hello: t.Hello) -> None:
        accepted, message = self.peers.hello(peer, hello)
        if accepted and not hello.observer:
            self._last_heard = time.monotonic()
            self._greeted = True
        welcome = t.Welcome(
            protocol_version=t.PROTOCOL_VERSION,
            rank=self.rank,
            world_size=self.config.world_size,
            accepted=accepted,
            message=message,
            pid=os.getpid(),
        )
        self.transport.send(peer, t.encode(welcome))

    def _handshake_refused(self, address: str) -> None:
        """A tcp:// peer without the instance's client key: refused before any frame."""
        self.counters.error("unauthenticated", self.metrics)
        self.peers.refusals.note(
            f"a connection from {address}", "CURVE handshake without the instance's client key"
        )

    # ---- data tasks -------------------------------------------------------------------------

    def _submit(self, item: Item) -> None:
        """Called under the gate's lock.

        Fast path: a small swap whose direction is idle runs on the loop thread right after
        admission (no thread hand-off either way; FIFO holds because nothing is queued ahead).
        """
        peer, task, keys = item
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
        future = self.executors[direction].submit(self._run, item)
        with self._pending_lock:
            self._pending[future] = item
        future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.pop(future, None)

    def _run_inline(self) -> None:
        while self._inline:
            self._run(self._inline.pop(0))

    def _run(self, item: Item) -> None:
        peer, task, keys = item
        start = time.perf_counter()
        try:
            if self.resources.datapath is None:
                raise KvtierError("the data path is closed (sleeping)")
            outcome = self.resources.datapath.run(task, keys)
        except KvtierError as e:
            self.counters.error(type(e).__name__, self.metrics)
            outcome = Outcome(t.Status.ERROR, message=f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: answered, logged with its traceback, worker goes on
            log.exception("rank %d: task %d failed", self.rank, task.task_id)
            self.counters.error("internal", self.metrics)
            outcome = Outcome(t.Status.ERROR, message=f"internal error: {type(e).__name__}: {e}")
        finally:
            with self._pending_lock:
                self._busy[t.DIRECTIONS[type(task)]] -= 1
            self.gate.done(item)
        seconds = time.perf_counter() - start
        kind = t.task_name(task)
        self.counters.task(
            kind,
            outcome.status.value,
            outcome.bytes_moved,
            seconds,
            self.metrics,
            blocks=len(outcome.blocks),
            skipped=outcome.count,
        )
        # Storage transfers are logged like the old system did (block count, elapsed time);
        # swaps and lookups, thousands a second, only at DEBUG. Numbers go to stats().
        quiet = t.DIRECTIONS[type(task)] in QUIET_DIRECTIONS
        log.log(
            logging.DEBUG if quiet else logging.INFO,
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
            task_id=task.task_id,
            status=outcome.status,
            blocks=outcome.blocks,
            count=outcome.count,
            bytes_moved=outcome.bytes_moved,
            seconds=seconds,
            message=outcome.message,
            rank=self.rank,
        )
        self.transport.send(peer, t.encode(result))

    def _answer(self, peer: Peer, task_id: int, status: t.Status, message: str, **extra) -> None:
        result = t.Result(task_id=task_id, status=status, message=message, rank=self.rank, **extra)
        self.transport.send(peer, t.encode(result))

    def _cancel_item(self, item: Item, why: str) -> None:
        peer, task, _ = item
        self._answer(peer, task.task_id, t.Status.CANCELLED, why)

    def _reply_control(self, peer: Peer, task: t.Control, answer: Answer) -> None:
        status = t.Status.OK if answer.code == t.Code.OK else t.Status.ERROR
        self._answer(peer, task.task_id, status, answer.message, code=answer.code, data=answer.data)

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        storage = self.resources.storage
        usage = storage.usage() if storage is not None else None
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self._started_at, 3),
            "state": self.gate.state.value,
            "in_flight": self.gate.in_flight,
            "held": self.gate.held,
            "queue_depths": {d.value: ex._work_queue.qsize() for d, ex in self.executors.items()},
            **self.counters.snapshot(),
            "storage": storage.stats.as_dict() if storage is not None else {},
            "storage_usage": vars(usage) if usage is not None else {},
            "storage_backend": self.config.storage.get("backend", "file"),
            "weight_version": self.resources.keys.version,
            "version_pinned": self.resources.versions.pinned,
            "namespace": self.config.namespace,
            "fingerprint": self.config.spec.fingerprint,
            "endpoint": self.config.endpoint_address,
        }

    # ---- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Answer everything still pending, release what this worker holds."""
        if not self._started:
            return
        self.gate.set_state(WorkerState.STOPPING)
        for item in self.gate.take_held():
            self._cancel_item(item, "worker is shutting down")
        with self._pending_lock:
            queued = dict(self._pending)  # cancelled futures leave _pending as they cancel
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for future, item in queued.items():
            if future.cancelled():
                self._cancel_item(item, "worker shut down before the task ran")
                self.gate.done(item)
        for executor in self.executors.values():
            executor.shutdown(wait=True)
        self.control.close()
        if self._shutdown_request is not None:
            peer, task_id = self._shutdown_request
            self._answer(peer, task_id, t.Status.OK, "worker stopped")
        self.transport.flush(0.05)
        self.transport.close()
        self._release()
        if self.exit_code == EXIT_ENGINE_LOST:
            # The engine died without cleaning up: what it owned (its device caches, its launch
            # directory) is provably orphaned now. Remove it rather than leave it to pile up.
            from kvtier.launcher import reclaim_orphans

            reclaim_orphans()
        log.info("rank %d: stopped", self.rank)

    def _release(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.resources.close()
        self.claim.release()


def _weigh(item: Item) -> tuple[Peer, int]:
    """A task's owner (its peer) and size: every block id and hash it carries."""
    peer, task, _ = item
    lists = (getattr(task, name) for name in task.__struct_fields__)
    return peer, sum(len(value) for value in lists if isinstance(value, list))


def _lower_priority() -> None:
    """Thread initializer: this thread (and threads it starts) yields to the engine's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as e:  # a container may forbid it: saves then run at normal priority
        log.debug("could not lower the save thread's priority: %s", e)
