"""`kvtier bench latency`: a 1-block swap_out round trip through the client, beside a raw
ZeroMQ request-reply (a heartbeat echoed by the same workers over the same sockets).

Both go engine -> every rank -> engine; the difference is kvtier's own cost (task encoding,
admission, the copy of one block, fan-in).
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from collections.abc import Sequence

from kvtier import DeviceCache, KVCacheSpec
from kvtier.client import Client
from kvtier.device import cache_name
from kvtier_bench.common import emit, progress, standalone
from kvtier_bench.options import latency_arguments as add_arguments

COLUMNS = [
    ("what", "round trip", "s"),
    ("ranks", "ranks", "d"),
    ("n", "N", "d"),
    ("p50_us", "p50 us", ".0f"),
    ("p99_us", "p99 us", ".0f"),
    ("mean_us", "mean us", ".0f"),
]


def _stats(what: str, ranks: int, samples: list[float], transport: str) -> dict:
    ordered = sorted(samples)
    return {
        "what": what,
        "ranks": ranks,
        "n": len(samples),
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
        "transport": transport,
    }


def _transport_settings(transport: str, directory: str) -> dict:
    """Worker settings for ``transport``: tcp:// on free loopback ports, with a secret."""
    if transport == "ipc":
        return {}
    import os
    import socket

    from kvtier.auth import write_key

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key_file = os.path.join(directory, "secret")
    write_key(key_file)
    return {"endpoint": f"tcp://127.0.0.1:{port}", "auth_key_file": key_file}


def run(args: argparse.Namespace) -> list[dict]:
    import tempfile
    import time

    spec = KVCacheSpec(num_layers=8, num_blocks=64, num_kv_heads=8, block_size=16, head_dim=128)
    instance = f"lat{uuid.uuid4().hex[:8]}"
    caches = [DeviceCache.create(spec, cache_name(instance, r)) for r in range(args.ranks)]
    secrets = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
    try:
        progress(f"launching {args.ranks} workers ({args.transport})")
        settings = _transport_settings(args.transport, secrets.name)
        with Client.launch(
            spec,
            args.ranks,
            {"backend": "memory"},
            instance_id=instance,
            num_host_blocks=64,
            **settings,
        ) as client:
            swap, raw = [], []
            for i in range(args.n + 200):  # interleaved, the first 200 warm up
                start = time.perf_counter()
                client.swap_out([i % 64], [i % 64])
                took = time.perf_counter() - start
                ping = client.ping()
                if i >= 200:
                    swap.append(took)
                    raw.append(ping)
    finally:
        secrets.cleanup()
        for cache in caches:
            cache.close()
    rows = [
        _stats("swap_out 1 block", args.ranks, swap, args.transport),
        _stats("raw zmq req-rep", args.ranks, raw, args.transport),
    ]
    rows[0]["overhead_p50_us"] = rows[0]["p50_us"] - rows[1]["p50_us"]
    rows[0]["block_bytes"] = spec.block_bytes
    return rows


def report(args: argparse.Namespace) -> int:
    rows = run(args)
    title = (
        f"kvtier bench latency ({args.transport}, {args.ranks} ranks, {args.n} round trips each, "
        f"1 block = {rows[0]['block_bytes'] >> 10} KiB)"
    )
    emit(rows, args.json, title, COLUMNS)
    if not args.json:
        print(
            f"kvtier overhead above the raw round trip (p50): {rows[0]['overhead_p50_us']:.0f} us"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("latency", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
