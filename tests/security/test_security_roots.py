"""A local user who makes a store root, a log directory or ``--keep-store`` first, in a shared
sticky directory (``/tmp/kv``, ``/dev/shm/kv``), plants a forged object with a valid checksum and
waits for the victim: refused before anything in it is read or written
(``kvtier.common.user_dirs``).

The attacker is uid 12345 with no group: giving it files needs root (CI runs as root); elsewhere
those cases skip with that reason. A parent writable by others runs as any user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import SPECS
from kvtier.errors import ConfigError
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.memory.host import HostPool
from kvtier.storage.file.store import FileStore

SPEC = SPECS["bf16"]
ATTACKER = 12345
PLANTED = 0x5A


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as another user (uid 12345) needs root (CI runs as root)")


def _victims_keys(n: int) -> list[str]:
    """The keys of the victim's prompt: the attacker knows the prompt (a shared system prompt)."""
    tokens = np.arange(n * SPEC.block_size) + 11
    return KeyScheme("victim", SPEC.fingerprint, 0).keys(block_hashes(tokens, SPEC.block_size))


@pytest.fixture
def sticky():
    """A directory like /tmp: root's, mode 1777."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-sticky-"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _squat(root: Path, keys: list[str]) -> None:
    """``root`` made first by the attacker (0700), holding objects for ``keys`` whose payload is
    the attacker's (valid checksums: without a MAC key nothing tells them apart)."""
    with FileStore(SPEC, {"root": root}) as store, HostPool(SPEC, len(keys)) as pool:
        blocks = [pool.block(i) for i in range(len(keys))]
        for b in blocks:
            b[:] = PLANTED
        assert store.put_from(keys, blocks) == [True] * len(keys)
    for path in [root, *root.rglob("*")]:
        os.chown(path, ATTACKER, ATTACKER, follow_symlinks=False)


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under ``root``: (owner, mode, contents of files)."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        data = path.read_bytes() if path.is_file() else b""
        out[str(path.relative_to(root))] = (st.st_uid, st.st_mode, data)
    return out


def test_a_store_root_another_user_made_first_is_refused_before_anything_is_touched(
    sticky,
) -> None:
    """Reproduced before the guard: the victim's lookup answered 1 and the load returned the
    attacker's bytes; the attacker could later delete what the victim stored."""
    _needs_root()
    root = sticky / "kv"
    keys = _victims_keys(4)
    _squat(root, keys)
    before = _tree(root)
    with pytest.raises(ConfigError) as refused:
        FileStore(SPEC, {"root": root})
    message = str(refused.value)
    assert message.startswith("storage.root: refusing ")
    assert f"uid {ATTACKER}" in message and "not to you" in message
    assert _tree(root) == before  # nothing read into kvtier, nothing written, nothing removed
    # ... also below it, and through a link the attacker made to a directory of ours.
    with pytest.raises(ConfigError, match=f"uid {ATTACKER}"):
        FileStore(SPEC, {"root": root / "deeper"})
    assert _tree(root) == before
    ours = sticky / "ours"
    ours.mkdir(mode=0o700)
    link = sticky / "link"
    link.symlink_to(ours)
    os.chown(link, ATTACKER, ATTACKER, follow_symlinks=False)
    with pytest.raises(ConfigError, match=f"symbolic link made by uid {ATTACKER}"):
        FileStore(SPEC, {"root": link})
    assert list(ours.iterdir()) == []


def test_a_squatted_keep_store_and_log_dir_are_refused_by_the_commands(sticky) -> None:
    """The same squat reached through the operator's own settings: ``kvtier demo
    --keep-store`` and a client's ``log_dir`` end with one error line naming the owner."""
    _needs_root()
    root = sticky / "kv"
    _squat(root, _victims_keys(2))
    before = _tree(root)
    env = {**os.environ, "TMPDIR": str(sticky), "XDG_RUNTIME_DIR": str(sticky)}
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", "demo", "--keep-store", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtier: error: keep_store: refusing ") and f"uid {ATTACKER}" in last
    assert "Traceback" not in out.stderr
    assert _tree(root) == before

    from kvtier.engine.client import Client
    from kvtier.layout.spec import KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_blocks=4, num_kv_heads=1, block_size=16, head_dim=8)
    with pytest.raises(ConfigError, match=rf"log_dir: refusing .*uid {ATTACKER}"):
        Client.launch(spec, 1, {"backend": "memory"}, log_dir=root / "logs")
    assert _tree(root) == before


def test_a_parent_writable_by_others_without_the_sticky_bit_is_refused(tmp_path) -> None:
    """Anyone may rename a directory in a parent open to all: the root made there today could
    be swapped for the attacker's tomorrow."""
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    with pytest.raises(ConfigError, match="writable by others without the sticky bit"):
        FileStore(SPEC, {"root": open_parent / "kv"})
    assert list(open_parent.iterdir()) == []  # refused before it was made
    os.chmod(open_parent, 0o1777)  # sticky: entries keep their owners; taken
    with FileStore(SPEC, {"root": open_parent / "kv"}):
        pass
    root_open_to_all = tmp_path / "root-open"
    root_open_to_all.mkdir()
    os.chmod(root_open_to_all, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        FileStore(SPEC, {"root": root_open_to_all})


def test_a_tmpdir_others_may_rename_in_is_refused_for_sockets_and_launches(
    tmp_path, monkeypatch
) -> None:
    """kvtier makes private names in TMPDIR (the socket directory, launch directories): in a
    directory open to all without the sticky bit, anyone could rename them and put their own
    in place (a fake worker's socket)."""
    import tempfile as tempfile_module

    from kvtier.engine import launcher
    from kvtier.worker.config import default_socket_dir

    open_tmp = tmp_path / "tmp"
    open_tmp.mkdir()
    os.chmod(open_tmp, 0o777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(open_tmp))
    monkeypatch.setattr(tempfile_module, "tempdir", None)  # read TMPDIR again
    with pytest.raises(ConfigError, match="TMPDIR: refusing .* without the sticky bit"):
        default_socket_dir()
    with pytest.raises(ConfigError, match="TMPDIR: refusing"):
        launcher._private_directory("attacked")
    assert list(open_tmp.iterdir()) == []
    os.chmod(open_tmp, 0o1777)  # as /tmp is: taken
    assert default_socket_dir().parent == open_tmp
