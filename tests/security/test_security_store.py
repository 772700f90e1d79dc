"""Attacks on a file store shared on purpose (``permissions: group``) by a member of its group:
directories swapped for links while the store starts and while it runs, and the modes a group
store gets under the usual umask.

As root (CI), the attacker is another account (uid/gid 65534, the store's group) running a shell
loop under ``setpriv``; elsewhere it runs as this user, which can do the same swaps.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import SPECS
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.memory.host import HostPool
from kvtier.storage.file.store import FileStore

SPEC = SPECS["bf16"]
NOBODY = 65534
ATTACK_S = 4.0


def _keys(n: int, seed: int = 0) -> list[str]:
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, 50_000, n * SPEC.block_size)
    scheme = KeyScheme("attack", SPEC.fingerprint, rank=0)
    return [scheme.key(h) for h in block_hashes(tokens, SPEC.block_size)]


@pytest.fixture
def shared_store():
    """(root, canary): an empty group store root the attacker's account can write, and a
    directory of the worker's user only (0700) holding files the attack aims at."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-shared-"))
    canary = Path(tempfile.mkdtemp(prefix="kvtier-canary-"))
    try:
        os.chmod(base, 0o755)  # the attacker may reach the store, not the canary
        root = base / "store"
        root.mkdir()
        if os.geteuid() == 0:
            os.chown(root, -1, NOBODY)
        os.chmod(root, 0o2770)
        names = ["notes.txt", "999999-1-1.tmp", "4000000-7-7.tmp"]
        names += [f"{i:02x}" + "a" * 62 + ".kvb" for i in range(16)]
        for name in names:
            (canary / name).write_bytes(b"precious " + name.encode())
        yield root, canary
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(canary, ignore_errors=True)


def _untouched(canary: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in canary.iterdir()}


@contextmanager
def _attacker(script: str, root: Path, canary: Path):
    """Run ``script`` (bash, in ``root``, ``$CANARY`` set) in a loop for ATTACK_S seconds."""
    script = script.strip().rstrip(";")
    loop = f"end=$((SECONDS+{int(ATTACK_S) + 2})); while [ $SECONDS -lt $end ]; do {script}; done"
    command = ["bash", "-c", loop]
    if os.geteuid() == 0:
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
    proc = subprocess.Popen(
        command,
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "CANARY": str(canary)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)
        assert proc.poll() is None, "the attack loop did not start"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _restore(root: Path) -> None:
    """Undo the attacker's renames, so that the store can be checked afterwards."""
    for parked in root.rglob("*.x"):
        target = parked.with_suffix("")
        if target.is_symlink() or not target.exists():
            target.unlink(missing_ok=True)
            parked.rename(target)


SWAP_TMP = (
    'mv -T tmp tmp.x 2>/dev/null; ln -sfn "$CANARY" tmp 2>/dev/null; '
    "rm -f tmp 2>/dev/null; mv -T tmp.x tmp 2>/dev/null"
)


def test_a_tmp_swapped_for_a_link_at_start_up_deletes_nothing_outside_the_root(
    shared_store,
) -> None:
    """A group member who swapped ``tmp/`` for a link during FileStore start-up won the race on
    the first try: opening the store deleted every file of a directory the attacker chose."""
    root, canary = shared_store
    before = _untouched(canary)
    opens = 0
    with _attacker(SWAP_TMP, root, canary):
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            with FileStore(SPEC, {"root": root, "permissions": "group"}):
                opens += 1
    assert opens >= 20
    assert _untouched(canary) == before
    _restore(root)
    assert not (root / "tmp").is_symlink()


SWAP_FANOUTS = (
    " ".join(
        f"mv -T objects/{i:02x} objects/{i:02x}.x 2>/dev/null; "
        f'ln -sfn "$CANARY" objects/{i:02x} 2>/dev/null;'
        for i in range(16)
    )
    + " sleep 0.01; "
    + " ".join(
        f"rm -f objects/{i:02x} 2>/dev/null; mv -T objects/{i:02x}.x objects/{i:02x} 2>/dev/null;"
        for i in range(16)
    )
)


def test_fanouts_swapped_for_links_while_open_get_no_write_and_no_eviction_outside_the_root(
    shared_store,
) -> None:
    """A fan-out directory swapped for a link while the store was open sent writes and LRU
    deletions through the link."""
    root, canary = shared_store
    before = _untouched(canary)
    keys = _keys(600)
    capacity = 40 * SPEC.block_bytes  # small: puts keep evicting, rescans keep listing
    config = {"root": root, "permissions": "group", "capacity_bytes": capacity}
    with HostPool(SPEC, 4) as pool, FileStore(SPEC, config) as store:
        for directory in [root / "objects", *(root / "objects").iterdir()]:
            os.chmod(directory, 0o2770)  # what operators did by hand before modes were explicit
        with _attacker(SWAP_FANOUTS, root, canary):
            end, i = time.monotonic() + ATTACK_S, 0
            while time.monotonic() < end:
                batch = keys[i % 600 : i % 600 + 4]
                store.put_from(batch, [pool.block(j) for j in range(len(batch))])
                store.exists_prefix(batch)
                store.get_into(batch[:1], [pool.block(0)])
                store._rescan()
                i += 4
        assert i >= 40
    assert _untouched(canary) == before
    _restore(root)
    with FileStore(SPEC, config) as store, HostPool(SPEC, 2) as pool:  # still works afterwards
        assert store.put_from(keys[:1], [pool.block(0)]) == [True]
        assert store.get_into(keys[:1], [pool.block(1)]) == [True]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_group_store_gets_group_modes_whatever_the_umask(tmp_path, umask) -> None:
    """Under the usual umask 022 ``permissions: group`` used to yield 2750 directories and 0640
    files: other members of the group could not write, and operators loosened modes by hand."""
    old = os.umask(umask)
    try:
        root = tmp_path / "store"
        config = {"root": root, "permissions": "group"}
        with FileStore(SPEC, config) as store, HostPool(SPEC, 2) as pool:
            keys = _keys(1)
            assert store.put_from(keys, [pool.block(0)]) == [True]
            obj = store._path(keys[0])
    finally:
        os.umask(old)
    for directory in (root, root / "objects", root / "tmp", obj.parent):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o2770, directory
    assert stat.S_IMODE(os.stat(obj).st_mode) == 0o660
