"""Prometheus metrics of one worker, served on an optional loopback port.

Stable names (every series carries ``rank``):

- ``kvtier_tasks_total{kind,status}`` — tasks answered, by task kind and status
- ``kvtier_task_bytes{kind}`` — histogram of bytes moved per task
- ``kvtier_task_seconds{kind}`` — histogram of task durations
- ``kvtier_errors_total{kind}`` — errors by kind (malformed, InvalidBlockIds, internal, ...)
- ``kvtier_storage_blocks_total{result}`` — storage reads: hit, miss, corrupt
- ``kvtier_storage_puts_total{result}`` — storage writes: ok, failed
- ``kvtier_storage_tier_blocks_total{tier,backend,result}`` — a tier chain's reads per tier:
  hit, miss, corrupt (each tier is asked for what the tiers above it lacked)
- ``kvtier_storage_tier_events_total{tier,backend,event}`` — per tier: evicted; on the top tier
  also promoted (loaded from below and put here), written_down, write_failed
- ``kvtier_storage_tier_pending_writes{tier}`` — objects in the top tier no lower tier holds yet
- ``kvtier_queue_depth{direction}`` — tasks waiting per executor
- ``kvtier_worker_state{state}`` — 1 for the current state (running, paused, sleeping, stopping)
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.common.http_bounds import BoundedHandler, BoundedHTTPServer
from kvtier.errors import ConfigError
from kvtier.worker.stats import tier_rows

log = logging.getLogger(__name__)

BYTES_BUCKETS = tuple(float(1 << s) for s in range(12, 34, 2))  # 4 KiB .. 8 GiB
SECONDS_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
STATES = ("running", "paused", "sleeping", "waking", "stopping")
MAX_CONNECTIONS = 8
CONNECTION_TIMEOUT_S = 5.0  # one read or write on a connection
# The request line and headers must arrive within this, however the peer paces its bytes: a
# peer trickling a byte every few seconds used to hold a slot forever (8 of them blinded every
# scrape). A scraper sends its request in one packet.
REQUEST_DEADLINE_S = 2.0


class WorkerMetrics:
    """Counters fed by the worker; gauges read from it at scrape time."""

    def __init__(self, rank: int, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.rank = str(rank)
        self.registry = CollectorRegistry()
        self._tasks = Counter(
            "kvtier_tasks", "Tasks answered", ["rank", "kind", "status"], registry=self.registry
        )
        self._bytes = Histogram(
            "kvtier_task_bytes",
            "Bytes moved per task",
            ["rank", "kind"],
            buckets=BYTES_BUCKETS,
            registry=self.registry,
        )
        self._seconds = Histogram(
            "kvtier_task_seconds",
            "Task duration",
            ["rank", "kind"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._errors = Counter(
            "kvtier_errors", "Errors by kind", ["rank", "kind"], registry=self.registry
        )
        self.registry.register(_Snapshot(self.rank, snapshot))
        self._server: Any = None

    def task(self, kind: str, status: str, nbytes: int, seconds: float) -> None:
        self._tasks.labels(self.rank, kind, status).inc()
        self._bytes.labels(self.rank, kind).observe(nbytes)
        self._seconds.labels(self.rank, kind).observe(seconds)

    def error(self, kind: str) -> None:
        self._errors.labels(self.rank, kind).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exporter on loopback; returns the port (useful with port 0)."""
        self._server = _BoundedServer((host, port), self.registry)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvtier-metrics", daemon=True
        )
        self._thread.start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _BoundedServer(BoundedHTTPServer):
    """Serves ``/metrics`` with at most ``MAX_CONNECTIONS`` handlers at once, each read bounded
    by ``CONNECTION_TIMEOUT_S`` and each request by ``REQUEST_DEADLINE_S``."""

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        super().__init__(
            address,
            _MetricsHandler,
            max_connections=MAX_CONNECTIONS,
            io_timeout_s=CONNECTION_TIMEOUT_S,
            request_deadline_s=REQUEST_DEADLINE_S,
        )


class _MetricsHandler(BoundedHandler):
    server: _BoundedServer

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.server.unwatch(self.connection)  # the request is in: the answer is ours to send
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class _Snapshot:
    """Values read from the worker when Prometheus scrapes."""

    def __init__(self, rank: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.rank, self.snapshot = rank, snapshot

    def collect(self):
        s = self.snapshot()
        blocks = CounterMetricFamily(
            "kvtier_storage_blocks", "Storage block reads", labels=["rank", "result"]
        )
        storage = s["storage"]
        for result, key in (("hit", "hits"), ("miss", "misses"), ("corrupt", "corrupt")):
            blocks.add_metric([self.rank, result], storage.get(key, 0))
        yield blocks
        puts = CounterMetricFamily(
            "kvtier_storage_puts", "Storage block writes", labels=["rank", "result"]
        )
        puts.add_metric([self.rank, "ok"], storage.get("puts", 0))
        puts.add_metric([self.rank, "failed"], storage.get("put_failures", 0))
        yield puts
        yield from self._tiers(tier_rows(s))
        depth = GaugeMetricFamily(
            "kvtier_queue_depth", "Tasks waiting per executor", labels=["rank", "direction"]
        )
        for direction, n in s["queue_depths"].items():
            depth.add_metric([self.rank, direction], n)
        yield depth
        state = GaugeMetricFamily(
            "kvtier_worker_state", "1 for the current state", labels=["rank", "state"]
        )
        for name in STATES:
            state.add_metric([self.rank, name], 1.0 if s["state"] == name else 0.0)
        yield state
        estimates = GaugeMetricFamily(
            "kvtier_estimate_seconds",
            "The engine's load-or-recompute estimates (kvtier.vllm.decide): prefill_s_per_token, "
            "step_s, per tier load_fixed_s and load_s_per_block, save_floor_s_per_block",
            labels=["rank", "what", "tier"],
        )
        for name, value in s.get("estimates", {}).items():
            tier = ESTIMATE_TIER.fullmatch(name)
            what, level = (tier.group(2), tier.group(1)) if tier else (name, "")
            estimates.add_metric([self.rank, what, level], value)
        yield estimates

    def _tiers(self, tiers: list[dict[str, Any]]):
        if not tiers:
            return
        labels = ["rank", "tier", "backend"]
        blocks = CounterMetricFamily(
            "kvtier_storage_tier_blocks", "Block reads per storage tier", labels=[*labels, "result"]
        )
        events = CounterMetricFamily(
            "kvtier_storage_tier_events", "Tier chain events per tier", labels=[*labels, "event"]
        )
        pending = GaugeMetricFamily(
            "kvtier_storage_tier_pending_writes",
            "Objects in the top tier that no lower tier holds yet",
            labels=[*labels],
        )
        for t in tiers:
            where = [self.rank, str(t["tier"]), t["backend"]]
            for result, key in (("hit", "hits"), ("miss", "misses"), ("corrupt", "corrupt")):
                blocks.add_metric([*where, result], t.get(key, 0))
            for event, key in TIER_EVENTS:
                if key in t:
                    events.add_metric([*where, event], t[key])
            if "pending_writes" in t:
                pending.add_metric(where, t["pending_writes"])
        yield from (blocks, events, pending)


ESTIMATE_TIER = re.compile(r"tier(\d+)_(.+)")

TIER_EVENTS = (
    ("evicted", "evictions"),
    ("promoted", "promotions"),
    ("written_down", "written"),
    ("write_failed", "write_failures"),
)


def start_exporter(
    rank: int, snapshot: Callable[[], dict[str, Any]], port: int
) -> tuple[WorkerMetrics, int]:
    """A worker's exporter serving on 127.0.0.1:``port`` (0: any free port), and its port;
    a port that cannot be served is a ConfigError naming ``metrics_port``."""
    metrics = WorkerMetrics(rank, snapshot)
    try:
        served = metrics.serve(port)
    except OSError as e:
        raise ConfigError(
            "metrics_port", f"cannot serve metrics on 127.0.0.1:{port}: {e}"
        ) from None
    log.info("rank %d: metrics on http://127.0.0.1:%d/metrics", rank, served)
    return metrics, served
