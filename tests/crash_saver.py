"""Run as a script: fork writers that save large batches to a file store and SIGKILL them.

``python crash_saver.py ROOT ITERATIONS SEED`` prints one JSON line per iteration. This process
never starts a thread (only its forked children do), so fork is safe. After each kill it checks,
without trusting the writer, that every visible object is whole: header and checksum valid and
the payload exactly the bytes the writer meant to store.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.format import HEADER_BYTES, ObjectFormat

SPEC = KVCacheSpec(num_layers=16, num_blocks=1, num_kv_heads=8, block_size=64, head_dim=128)
BLOCKS_PER_SAVE = 16
MAX_SAVES = 48  # the writer saves batch after batch until killed (it never gets this far)


@functools.cache
def content(slot: int) -> np.ndarray:
    return np.random.default_rng(slot).integers(0, 256, SPEC.block_bytes, dtype=np.uint8)


def batch_keys(iteration: int, batch: int) -> list[str]:
    scheme = KeyScheme(f"crash{iteration}", SPEC.fingerprint)
    tokens = np.arange(BLOCKS_PER_SAVE * SPEC.block_size) + (iteration * 1000 + batch) * 100_000
    return scheme.keys(block_hashes(tokens, SPEC.block_size))


def writer(root: str, iteration: int, ready_fd: int) -> None:
    import torch

    from kvtier.memory.host import HostPool
    from kvtier.storage.file.store import FileStore

    with (
        HostPool(SPEC, BLOCKS_PER_SAVE, pin=False) as pool,
        FileStore(SPEC, {"root": root}) as store,
    ):
        for slot in range(BLOCKS_PER_SAVE):
            pool.block(slot).copy_(torch.from_numpy(content(slot)))
        blocks = [pool.block(slot) for slot in range(BLOCKS_PER_SAVE)]
        os.write(ready_fd, b"x")
        for batch in range(MAX_SAVES):
            store.put_from(batch_keys(iteration, batch), blocks)
    os._exit(0)


def run_iterations(root, iterations: int, seed: int, timeout_s: float) -> list[dict]:
    """Run this script in a fresh interpreter (no threads before fork); its per-kill rows."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    out = subprocess.run(
        [sys.executable, str(here / "crash_saver.py"), str(root), str(iterations), str(seed)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=here,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == iterations
    return rows


def main() -> int:
    root, iterations, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    from kvtier.storage.file.store import FileStore

    for it in range(iterations):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            writer(root, it, ready_w)
        os.close(ready_w)
        os.read(ready_r, 1)  # the writer is about to save
        os.close(ready_r)
        delay = rng.uniform(0.0, 0.2)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        # What a reader now sees. exists_prefix runs no threads.
        store = FileStore(SPEC, {"root": root})
        visible = whole = 0
        prefix_ok = True
        all_keys = []
        for batch in range(MAX_SAVES):
            keys = batch_keys(it, batch)
            all_keys += keys
            present = [store.exists_prefix([k]) == 1 for k in keys]
            prefix_ok &= store.exists_prefix(keys) == (present + [False]).index(False)
            for slot, (key, here) in enumerate(zip(keys, present)):
                if not here:
                    continue
                visible += 1
                data = store.read_object(key)
                payload = memoryview(data)[HEADER_BYTES : HEADER_BYTES + SPEC.block_bytes]
                ObjectFormat(SPEC.fingerprint).check(
                    data[:HEADER_BYTES], [payload], key, SPEC.block_bytes
                )  # raises ObjectCorrupt on a torn object
                if np.array_equal(np.frombuffer(payload, np.uint8), content(slot)):
                    whole += 1
        tmp_left = sum(1 for _ in Path(root).rglob("*.tmp"))  # beside the objects, or in tmp/
        partial_batch = visible % BLOCKS_PER_SAVE != 0
        print(
            json.dumps(
                {
                    "iteration": it,
                    "delay_s": round(delay, 3),
                    "killed": killed,
                    "visible": visible,
                    "whole": whole,
                    "prefix_ok": prefix_ok,
                    "partial_batch": partial_batch,
                    "tmp_left": tmp_left,
                }
            ),
            flush=True,
        )
        store.delete(all_keys)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
