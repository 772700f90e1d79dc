"""`kvtier bench latency`: what a message costs, beside what ZeroMQ alone costs on this machine.

For each rank count (default 1, 2, 4, 8), interleaved in one loop so that all rows see the same
machine:
- ``zmq echo``: the transport's limit — one DEALER per rank in this process, each talking to a
  bare ROUTER echo process (pyzmq only, no kvtier code), send to all, wait for all;
- ``heartbeat``: kvtier's ping (the client's I/O thread, the worker's loop);
- ``swap_out 1 block``: a 1-block task through the client (the calling thread's own
  connection, ``kvtier.engine.direct``) and every worker, copy included;
- ``lookup 64 keys``: a lookup of 64 stored blocks.
Then ``lookups/s``: one client keeping ``--window`` lookups of 64 keys in flight
(``Client.submit``) for ``--seconds``: the rate, and each lookup's latency p50 / p99, beside the
bare echo's rate with the same window (``echo per s``: the transport's limit).

``- echo`` columns: a row's p50 and p99 minus the echo's — kvtier's own cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial

from kvtier import DeviceCache, KVCacheSpec
from kvtier.engine.client import Client
from kvtier.memory.device import cache_name
from kvtier_bench.common import emit, progress, standalone
from kvtier_bench.options import latency_arguments as add_arguments

COLUMNS = [
    ("what", "round trip", "s"),
    ("ranks", "ranks", "d"),
    ("n", "N", "d"),
    ("p50_us", "p50 us", ".0f"),
    ("p99_us", "p99 us", ".0f"),
    ("over_echo_p50_us", "- echo p50", ".0f"),
    ("over_echo_p99_us", "- echo p99", ".0f"),
    ("per_s", "per s", ".0f"),
    ("echo_per_s", "echo per s", ".0f"),
]
WARM_UP = 200
LOOKUP_KEYS = 64
# A small block (4 layers x K,V x 2 heads x 16 tokens x 64 dims, bf16: 32 KiB): the copy is a
# few microseconds, so the row measures the message path rather than memcpy.
SPEC = KVCacheSpec(num_layers=4, num_blocks=128, num_kv_heads=2, block_size=16, head_dim=64)

# The echo server: pyzmq only, nothing of kvtier (it runs with -I: no site, no cwd on the path).
ECHO = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.bind(sys.argv[1])
sys.stdout.write("ready\\n"); sys.stdout.flush()
while True:
    frames = sock.recv_multipart()
    sock.send_multipart(frames)
"""


class EchoServers:
    """One bare ROUTER echo process per rank, and a DEALER to each."""

    def __init__(self, ranks: int, directory: str) -> None:
        import zmq

        self.context = zmq.Context()
        self.processes: list[subprocess.Popen] = []
        self.sockets = []
        for r in range(ranks):
            address = f"ipc://{directory}/echo{r}.sock"
            process = subprocess.Popen(
                [sys.executable, "-c", ECHO, address], stdout=subprocess.PIPE, text=True
            )
            self.processes.append(process)
            if process.stdout is None or process.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo server did not start")
            sock = self.context.socket(zmq.DEALER)
            sock.connect(address)
            self.sockets.append(sock)

    def round_trip(self, payload: bytes = b"x" * 64) -> float:
        start = time.perf_counter()
        for sock in self.sockets:
            sock.send(payload)
        for sock in self.sockets:
            sock.recv()
        return time.perf_counter() - start

    def rate(self, window: int, seconds: float) -> float:
        """Round trips per second with ``window`` in flight (each to every rank)."""
        import zmq

        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        answers: dict[bytes, int] = {}
        sent = done = 0
        start = time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end or answers:
            while len(answers) < window and time.perf_counter() < end:
                tag = sent.to_bytes(8, "little")
                sent += 1
                answers[tag] = 0
                for sock in self.sockets:
                    sock.send(tag)
            for sock, _ in poller.poll(1000):
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    tag = sock.recv()
                    answers[tag] += 1
                    if answers[tag] == len(self.sockets):
                        del answers[tag]
                        done += 1
        return done / (time.perf_counter() - start)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()
        for process in self.processes:
            process.kill()
            process.wait()


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(what: str, ranks: int, samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "what": what,
        "ranks": ranks,
        "n": len(samples),
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": _percentile(ordered, 0.99) * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _lookup_rate(client: Client, hashes: list[bytes], window: int, seconds: float) -> dict:
    """Lookups kept ``window`` in flight for ``seconds``: rate and latencies."""
    from kvtier.transport import tasks as t

    latencies: list[float] = []
    in_flight: list[tuple[float, object]] = []
    end = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < end or in_flight:
        while len(in_flight) < window and time.perf_counter() < end:
            future = client.submit(t.Lookup(block_hashes=hashes))
            in_flight.append((time.perf_counter(), future))
        sent, future = in_flight.pop(0)
        if future.result().count != len(hashes):  # type: ignore[attr-defined]
            raise RuntimeError("a lookup of stored blocks did not find them all")
        latencies.append(time.perf_counter() - sent)
    elapsed = time.perf_counter() - start
    return {"per_s": len(latencies) / elapsed, "window": window, "samples": latencies}


def _measure(args: argparse.Namespace, ranks: int, directory: str) -> list[dict]:
    instance = f"lat{uuid.uuid4().hex[:8]}"
    caches = [DeviceCache.create(SPEC, cache_name(instance, r)) for r in range(ranks)]
    echo = EchoServers(ranks, directory)
    try:
        with Client.launch(
            SPEC, ranks, {"backend": "memory"}, instance_id=instance, num_host_blocks=128
        ) as client:
            hashes = [os.urandom(16) for _ in range(LOOKUP_KEYS)]
            client.save(hashes, list(range(LOOKUP_KEYS)))
            samples: dict[str, list[float]] = {k: [] for k in ("echo", "beat", "swap", "look")}
            for i in range(args.n + WARM_UP):
                block = LOOKUP_KEYS + i % LOOKUP_KEYS
                took = {
                    "echo": echo.round_trip(),
                    "beat": client.ping(),
                    "swap": _timed(partial(client.swap_out, [block], [block])),
                    "look": _timed(partial(client.lookup, hashes)),
                }
                if i >= WARM_UP:
                    for name, seconds in took.items():
                        samples[name].append(seconds)
            rate = _lookup_rate(client, hashes, args.window, args.seconds)
            echo_rate = echo.rate(args.window, args.seconds)
    finally:
        echo.close()
        for cache in caches:
            cache.close()
    rows = [
        _row("zmq echo (no kvtier)", ranks, samples["echo"]),
        _row("heartbeat", ranks, samples["beat"]),
        _row("swap_out 1 block", ranks, samples["swap"]),
        _row(f"lookup {LOOKUP_KEYS} keys", ranks, samples["look"]),
        {
            **_row(f"lookups/s, {args.window} in flight", ranks, rate["samples"]),
            "per_s": rate["per_s"],
            "echo_per_s": echo_rate,
            "of_echo_rate": rate["per_s"] / echo_rate,
        },
    ]
    for row in rows[1:]:
        row["over_echo_p50_us"] = row["p50_us"] - rows[0]["p50_us"]
        row["over_echo_p99_us"] = row["p99_us"] - rows[0]["p99_us"]
    for row in rows:
        row["block_bytes"] = SPEC.block_bytes
        row["load_average"] = os.getloadavg()[0]
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as directory:
        for ranks in args.ranks:
            progress(f"{ranks} ranks: {args.n} round trips of each kind, then lookups/s")
            rows += _measure(args, ranks, directory)
    return rows


def report(args: argparse.Namespace) -> int:
    rows = run(args)
    title = (
        f"kvtier bench latency (ipc, {args.n} round trips each, interleaved; "
        f"1 block = {SPEC.block_bytes >> 10} KiB; load average {os.getloadavg()[0]:.2f})"
    )
    emit(rows, args.json, title, COLUMNS)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("latency", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
