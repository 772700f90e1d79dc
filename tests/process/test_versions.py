"""Weight versions: no stale hit, ever — with tasks in flight, held by pause, across resume."""

from __future__ import annotations

import hashlib
import random
import threading

import numpy as np
import torch

from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.storage.file.store import FileStore
from kvtier.transport import tasks as t
from worker_helpers import WSPEC, engine


def hashes(n: int, seed: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * WSPEC.block_size)
    return block_hashes(tokens, WSPEC.block_size)


def content(version: str, block_hash: bytes) -> torch.Tensor:
    """What the engine computes for a block under a given weight version."""
    seed = int.from_bytes(hashlib.sha256(version.encode() + block_hash).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (WSPEC.block_bytes,), dtype=torch.uint8, generator=gen)


def write_block(cache, device_block: int, data: torch.Tensor) -> None:
    offset = 0
    for row in cache.tensors:
        for tensor in row:
            raw = tensor[device_block].view(-1).view(torch.uint8)
            raw.copy_(data[offset : offset + raw.numel()])
            offset += raw.numel()


def read_block(cache, device_block: int) -> torch.Tensor:
    return torch.cat(
        [x[device_block].reshape(-1).view(torch.uint8) for r in cache.tensors for x in r]
    )


def stored_versions(root, block_hash: bytes, versions: list[str]) -> list[str]:
    with FileStore(WSPEC, {"root": root}) as store:
        return [
            v
            for v in versions
            if store.exists_prefix([KeyScheme("default", WSPEC.fingerprint, 0, v).key(block_hash)])
        ]


def test_queued_saves_keep_the_version_they_were_submitted_under(tmp_path) -> None:
    """Saves queued behind slow storage when update_weights arrives are stored under the old
    version; saves submitted after it under the new one. (They used to take the new version
    when they ran: stale hits after the update.)"""
    root = tmp_path / "store"
    storage = {"backend": "file", "root": str(root), "faults": {"latency_s": 0.2}}
    with engine(tmp_path, world_size=1, storage=storage) as (client, (cache,)):
        assert client.control("update_weights", version="RL-STEP1").code == 200
        old, new = hashes(4, 1), hashes(4, 2)
        for i, h in enumerate(old):
            write_block(cache, i, content("RL-STEP1", h))
        futures = [
            client.submit(t.Save(block_hashes=[h], device_block_ids=[i])) for i, h in enumerate(old)
        ]
        update = client.submit(t.Control(method="update_weights", args={"version": "RL-STEP2"}))
        for i, h in enumerate(new):
            write_block(cache, 10 + i, content("RL-STEP2", h))
        futures += [
            client.submit(t.Save(block_hashes=[h], device_block_ids=[10 + i]))
            for i, h in enumerate(new)
        ]
        assert update.result(30).code == 200
        assert all(f.result(30).status is t.Status.OK for f in futures)
    for h in old:
        assert stored_versions(root, h, ["RL-STEP1", "RL-STEP2"]) == ["RL-STEP1"]
    for h in new:
        assert stored_versions(root, h, ["RL-STEP1", "RL-STEP2"]) == ["RL-STEP2"]


def test_saves_held_by_pause_keep_their_version_across_update_and_resume(tmp_path) -> None:
    root = tmp_path / "store"
    with engine(tmp_path, world_size=1, storage={"backend": "file", "root": str(root)}) as (
        client,
        (cache,),
    ):
        assert client.control("update_weights", version="RL-STEP1").code == 200
        assert client.control("pause").code == 200
        held = hashes(3, 3)
        for i, h in enumerate(held):
            write_block(cache, i, content("RL-STEP1", h))
        futures = [
            client.submit(t.Save(block_hashes=[h], device_block_ids=[i]))
            for i, h in enumerate(held)
        ]
        assert client.control("update_weights", version="RL-STEP2").code == 200
        assert client.control("resume").code == 200
        assert all(f.result(30).status is t.Status.OK for f in futures)
        assert client.lookup(held) == 0  # under RL-STEP2: nothing of the old weights
    for h in held:
        assert stored_versions(root, h, ["RL-STEP1", "RL-STEP2"]) == ["RL-STEP1"]


def test_resume_does_not_undo_an_explicit_version(tmp_path) -> None:
    """An explicit version pins until the next explicit update or an explicit re-read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP1-20250101-abc\n")
    with engine(tmp_path, world_size=1, model_dir=str(model)) as (client, _):
        stats = client.control("stats").per_rank[0].data
        assert (stats["weight_version"], stats["version_pinned"]) == ("RL-STEP1", False)
        answer = client.control("update_weights", version="RL-STEP5")
        assert answer.code == 200 and "pinned" in answer.message
        assert client.control("pause").code == 200
        resumed = client.control("resume")
        assert resumed.code == 200 and "RL-STEP1" not in resumed.message
        assert client.control("stats").per_rank[0].data["weight_version"] == "RL-STEP5"
        reread = client.control("update_weights")  # explicit re-read: back to the file's version
        assert reread.code == 200
        assert "'RL-STEP5' -> 'RL-STEP1'" in reread.message
        assert "can be hit again" in reread.message  # a rollback says what it means
        (model / "version.yaml").write_text("version: RL-STEP2-20250102-def\n")
        assert client.control("pause").code == 200
        assert "RL-STEP2" in client.control("resume").message  # unpinned: resume re-reads
        assert client.control("stats").per_rank[0].data["weight_version"] == "RL-STEP2"


def rollback(version: str) -> dict:
    """update_weights arguments that may go back to an earlier version (on purpose here)."""
    return {"version": version, "allow_rollback": True}


def test_concurrent_saves_loads_and_updates_never_hit_another_version(tmp_path, figures) -> None:
    """An engine thread saves blocks whose bytes depend on the weight version, loads earlier
    prefixes, and switches versions (directly, and inside pause/resume) without waiting for
    anything in flight. Every block a load returns must hold the bytes of the version the load
    was submitted under."""
    rng = random.Random(5)
    storage = {"backend": "file", "root": str(tmp_path / "store"), "faults": {"latency_s": 0.01}}
    versions = [f"RL-STEP{i}" for i in range(1, 6)]
    checked = hits = 0
    with engine(tmp_path, world_size=1, storage=storage) as (client, (cache,)):
        current = versions[0]
        assert client.control("update_weights", version=current).code == 200
        saved: list[bytes] = []
        pending: list = []
        lock = threading.Lock()
        for step in range(240):
            roll = rng.random()
            if roll < 0.05:
                current = rng.choice(versions)
                client.submit(t.Control(method="update_weights", args=rollback(current)))
            elif roll < 0.08:
                client.submit(t.Control(method="pause"))
                current = rng.choice(versions)
                client.submit(t.Control(method="update_weights", args=rollback(current)))
                client.submit(t.Control(method="resume"))
            elif roll < 0.55 or not saved:
                h = hashes(1, 10_000 + step)[0]
                block = step % 16  # not reused before its save is answered (see below)
                for f, b in list(pending):
                    if b == block:
                        f.result(30)
                write_block(cache, block, content(current, h))
                f = client.submit(t.Save(block_hashes=[h], device_block_ids=[block]))
                pending.append((f, block))
                with lock:
                    saved.append(h)
            else:
                h = rng.choice(saved)
                target = 20 + step % 16
                result = client.submit(t.Load(block_hashes=[h], device_block_ids=[target])).result(
                    30
                )
                checked += 1
                if result.blocks:
                    hits += 1
                    assert torch.equal(read_block(cache, target), content(current, h)), step
        for f, _ in pending:
            f.result(30)
    figures["loads"] = checked
    figures["hits_checked"] = hits
    figures["stale_hits"] = 0
    assert hits > 10  # the check had something to check
