"""`kvtier bench reuse --s3-outage SECONDS`: the kvtier server's store is ``tiers: [memory, file,
s3]`` over a real S3 server (SeaweedFS on 127.0.0.1), which is SIGKILLed ``SECONDS`` after vLLM's
client starts and started again (same data, same ports) ``SECONDS`` later, while the client runs.

What it shows beside the round's figures: failed requests (``measure`` refuses any), the
completions against the server without a connector (``bench reuse`` compares them), hits
throughout (the memory and file tiers serve on), and the S3 objects before the kill and at the
end (saves reach S3 again once it is back).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.storage import LocalS3Server

BUCKET = "kvtier-reuse"


@contextlib.contextmanager
def s3_chain(root: Path, outage_s: float) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(the storage config, what happened: filled in as the outage runs and at the end)."""
    server = LocalS3Server(root)
    server.start(bucket=BUCKET)
    happened: dict[str, Any] = {}
    s3 = {
        "backend": "s3",
        "endpoint": server.endpoint,
        "bucket": BUCKET,
        "credentials_file": str(server.write_credentials(root / "credentials")),
        "timeout_s": 2,
        "retries": 1,
    }
    storage = {
        "tiers": [
            {"backend": "memory", "capacity_bytes": 256 << 20},
            {"backend": "file", "root": str(root / "file")},
            s3,
        ]
    }
    stop = threading.Event()

    def outage() -> None:
        if stop.wait(outage_s):
            happened["s3_restarted"] = "the client ended before the kill: use fewer SECONDS"
            return
        happened["s3_objects_at_kill"] = _count(server)
        server.kill()
        if stop.wait(outage_s):
            happened["s3_restarted"] = False
            return
        server.start(bucket=BUCKET)
        happened["s3_restarted"] = True
        stop.wait()  # the server dies with the thread that started it: this one lives on

    timer = threading.Thread(target=outage, name="s3-outage", daemon=True)
    try:
        yield storage, {"start": timer.start, "happened": happened}
    finally:
        try:  # counted while the outage thread lives: the restarted server dies with it
            if happened.get("s3_restarted") is True:  # (PR_SET_PDEATHSIG); after the join,
                happened["s3_objects_at_end"] = _count(server)  # the count raced that death
        finally:  # and a failed count still stops the server (its sockets were left)
            stop.set()
            if timer.ident is not None:
                timer.join()
            server.stop()


def _count(server: LocalS3Server) -> int:
    import obstore

    return sum(len(page) for page in obstore.list(server.client(BUCKET)))
