"""Worker: one per tensor-parallel rank; answers every task it receives exactly once.

Threads and their jobs:
- the loop thread owns the transport: it decodes messages, answers hello and heartbeats, stamps
  data tasks with the weight version in force and admits them through the Gate, hands control
  requests to the ControlPlane, and watches the engine (``engine_timeout_s``, and the launching
  process: a worker whose launcher is gone exits at once);
- the TaskRunner's single-thread executors, one per direction (``kvtier.worker.task_runner``), so a
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
from typing import Any

import msgspec

from kvtier.common.cpus import run_on
from kvtier.memory import shm
from kvtier.storage import describe_backend
from kvtier.transport import tasks as t
from kvtier.transport.auth import CurveKeys
from kvtier.transport.base import Peer
from kvtier.transport.connect import server_transport
from kvtier.transport.endpoint import EndpointClaim
from kvtier.transport.turns import TurnSender
from kvtier.worker import deadline
from kvtier.worker.config import WorkerConfig
from kvtier.worker.control_plane import Answer, ControlPlane
from kvtier.worker.engine_watch import EngineWatch
from kvtier.worker.gate import Gate, Refusal, WorkerState
from kvtier.worker.orphans import reclaim_orphans
from kvtier.worker.peers import PeerTable
from kvtier.worker.resources import RankResources
from kvtier.worker.stats import TaskCounters
from kvtier.worker.task_runner import Item, TaskRunner

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_LOST = 3
POLL_INTERVAL_S = 0.1
FLUSH_TIMEOUT_S = 2.0


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
        self.watch = EngineWatch(config)
        self.peers = PeerTable(self.rank)
        self._thread: threading.Thread | None = None
        self._started = False
        self._started_at = time.time()
        # Answers given on the loop thread leave at the end of its turn, bundled per peer.
        self.out = TurnSender(lambda peer, payload: self.transport.send(peer, payload))

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
        self.runner = TaskRunner(
            self.resources,
            self.gate,
            self.counters,
            send=self.out.send,
            metrics=lambda: self.metrics,
            rank=self.rank,
        )
        self.control = ControlPlane(
            self.resources,
            self.gate,
            submit=self.runner.submit,
            reply=self._reply_control,
            cancel=self.runner.cancel,
            stats=self.stats,
            rank=self.rank,
        )
        self.transport = server_transport(cfg.endpoint_address, curve, self._handshake_refused)
        try:
            self.resources.open()
            self._start_metrics()
            self.transport.open()
        except BaseException:
            self.runner.shutdown()
            self.control.close()
            self._release()
            raise
        self._started = True
        self.watch.restart()
        log.info(
            "rank %d: serving %s (device cache %s, %d host blocks); storage %s; namespace %s, "
            "weight version %r",
            self.rank,
            cfg.endpoint_address,
            cfg.device_cache_name,
            cfg.num_host_blocks,
            self.resources.storage_summary(),
            cfg.namespace,
            self.resources.keys.version,
        )
        if background:
            self._thread = threading.Thread(
                target=self._loop, name=f"kvtier-worker-{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def _start_metrics(self) -> None:
        if self.config.metrics_port is not None:
            from kvtier.worker.metrics import start_exporter

            self.metrics, self.metrics_port = start_exporter(
                self.rank, self.control.snapshot, self.config.metrics_port
            )

    def serve(self) -> int:
        """Run until shutdown, SIGTERM / SIGINT or engine loss; return the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())
        run_on(self.config.cpu_cores)  # first: the threads started later inherit it
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
        self.runner.loop_ident = threading.get_ident()
        self.out.start()
        try:
            while not self._stop.is_set():
                for peer, payload in self.transport.receive(POLL_INTERVAL_S):
                    self._handle(peer, payload)
                    self.runner.run_inline()
                self.runner.shed_queued_saves()
                self.out.flush()
                why = self.watch.gone()
                if why:
                    log.error("rank %d: %s: exiting", self.rank, why)
                    self.exit_code = EXIT_ENGINE_LOST
                    break
        finally:
            self.out.stop()
            self._shutdown()

    def _handle(self, peer: Peer, payload: bytes, bundled: bool = False) -> None:
        try:
            message = t.decode(payload)
            if isinstance(message, t.Bundle) and bundled:
                raise msgspec.ValidationError("a bundle inside a bundle")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._malformed(peer, payload, e)
            return
        if isinstance(message, t.Bundle):
            for raw in message.items:  # each as if it came alone, small swaps run in between
                self._handle(peer, bytes(raw), bundled=True)
                self.runner.run_inline()
            return
        if isinstance(message, t.Hello):
            self._hello(peer, message)
            return
        if not self.peers.engine(peer):
            if self.peers.observer(peer):
                self._observe(peer, message)
            else:
                self._unintroduced(peer, message)
            return
        self.watch.heard()
        if isinstance(message, t.DATA_TASKS):
            # Stamped with the version in force now, and with when the client gives up.
            item = (peer, message, self.resources.keys, deadline.cutoff(message))
            refusal = self.gate.admit(item, self.runner.submit)
            if refusal is not None:
                stopping = refusal is Refusal.STOPPING
                status = t.Status.CANCELLED if stopping else t.Status.ERROR
                self._answer(peer, message.task_id, status, refusal.value)
        elif isinstance(message, t.Heartbeat):  # its stamp echoed: a ping finds its answer
            self.out.send(peer, t.encode(self.runner.save_watch.echo(message)))
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
            self.out.send(peer, t.encode(t.Heartbeat(sent_at=message.sent_at)))
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
            self.watch.heard(hello=True)
        welcome = t.Welcome(
            protocol_version=t.PROTOCOL_VERSION,
            rank=self.rank,
            world_size=self.config.world_size,
            accepted=accepted,
            message=message,
            pid=os.getpid(),
        )
        self.out.send(peer, t.encode(welcome))

    def _handshake_refused(self, address: str) -> None:
        """A tcp:// peer without the instance's client key: refused before any frame."""
        self.counters.error("unauthenticated", self.metrics)
        self.peers.refusals.note(
            f"a connection from {address}", "CURVE handshake without the instance's client key"
        )

    def _answer(self, peer: Peer, task_id: int, status: t.Status, message: str, **extra) -> None:
        result = t.Result(task_id=task_id, status=status, message=message, rank=self.rank, **extra)
        self.out.send(peer, t.encode(result))

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
            "queue_depths": self.runner.queue_depths(),
            **self.counters.snapshot(),
            "storage": storage.stats.as_dict() if storage is not None else {},
            "storage_usage": vars(usage) if usage is not None else {},
            "storage_backend": describe_backend(self.config.storage_config),
            # By level, fastest first ("0", "1", ...; their backends: ``storage_backend``);
            # counters only (a result's data nests three levels deep, the last of numbers).
            "storage_tiers": (
                {str(row.pop("tier")): (row.pop("backend"), row)[1] for row in storage.tier_stats()}
                if storage is not None
                else {}
            ),
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
            self.runner.cancel(item, "worker is shutting down")
        self.runner.shutdown()
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
    return item[0], t.id_count(item[1])
