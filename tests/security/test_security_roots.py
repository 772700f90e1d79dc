"""A local user who makes a store root, a log directory or ``--keep-store`` first, in a shared
sticky directory (``/tmp/kv``, ``/dev/shm/kv``), plants a forged object with a valid checksum and
waits for the victim: refused before anything in it is read or written
(``kvtier.common.user_dirs``).

The attacker is uid 12345 with no group: giving it files needs root (CI runs as root); elsewhere
those cases skip with that reason. A parent writable by others runs as any user.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import SPECS
from kvtier.errors import ConfigError, StorageError
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


# ---- round 5: write access the mode bits alone do not show ---------------------------------------

ACL_ACCESS, ACL_DEFAULT = "system.posix_acl_access", "system.posix_acl_default"


def _set_acl(path: Path, which: str, named_users: dict[int, int], group: int = 5) -> None:
    """What ``setfacl -m u:UID:PERM`` leaves (owner rwx, group ``group``, mask rwx, others
    r-x), written as the kernel's xattr so that the test needs no ``acl`` package."""
    entries = [(0x01, 7, 0xFFFFFFFF)]
    entries += [(0x02, perm, uid) for uid, perm in named_users.items()]
    entries += [(0x04, group, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)]
    data = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(path, which, data)


def _as_attacker(action: Callable[[], object], gid: int = ATTACKER) -> bool:
    """Whether ``action`` succeeded when run by uid 12345 with primary group ``gid`` and no
    other group (in a forked child: this Python lives under root's 0700 home)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(ATTACKER)
            action()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_a_directory_another_user_may_write_through_an_acl_is_refused(sticky) -> None:
    """Reproduced before the guard: ``setfacl -m u:12345:rwx`` on a root-owned 0775 directory
    passed the walk as a store root, a log-dir parent and TMPDIR (the group bits show the ACL's
    mask, and root's group had no listed member); uid 12345 could rename what kvtier made."""
    _needs_root()
    from kvtier.common.user_dirs import check_parent_directory
    from kvtier.engine.client import Client
    from kvtier.layout.spec import KVCacheSpec

    shared = sticky / "acl"
    shared.mkdir(mode=0o755)
    _set_acl(shared, ACL_ACCESS, {ATTACKER: 7})
    assert _as_attacker(lambda: open(shared / "planted", "w").close())  # the ACL lets it write
    os.unlink(shared / "planted")
    through_acl = f"uid {ATTACKER} through an ACL"
    with pytest.raises(ConfigError, match=f"storage.root: refusing .*{through_acl}"):
        FileStore(SPEC, {"root": shared})
    with pytest.raises(ConfigError, match=f"TMPDIR: refusing .*{through_acl} without the sticky"):
        check_parent_directory(shared, "TMPDIR")
    spec = KVCacheSpec(num_layers=1, num_blocks=4, num_kv_heads=1, block_size=16, head_dim=8)
    with pytest.raises(ConfigError, match=f"log_dir: refusing .*{through_acl}"):
        Client.launch(spec, 1, {"backend": "memory"}, log_dir=shared / "logs")
    assert list(shared.iterdir()) == []

    # A group store may let its own group write, never a named other user.
    group_store = sticky / "group-store"
    group_store.mkdir(mode=0o700)
    os.chmod(group_store, 0o2770)
    _set_acl(group_store, ACL_ACCESS, {ATTACKER: 7}, group=7)
    with pytest.raises(ConfigError, match=through_acl):
        FileStore(SPEC, {"root": group_store, "permissions": "group"})
    _set_acl(group_store, ACL_ACCESS, {}, group=7)  # mask and group only: the store's sharing
    with FileStore(SPEC, {"root": group_store, "permissions": "group"}):
        pass

    # A default ACL hands the attacker write on everything made inside.
    inherits = sticky / "inherits"
    inherits.mkdir(mode=0o700)
    _set_acl(inherits, ACL_DEFAULT, {ATTACKER: 7})
    with pytest.raises(ConfigError, match=f"default ACL that lets uid {ATTACKER}"):
        FileStore(SPEC, {"root": inherits})
    assert list(inherits.iterdir()) == []


def test_a_directory_writable_by_a_primary_group_others_share_is_refused(
    sticky, monkeypatch
) -> None:
    """Accounts that share a primary gid are not listed in /etc/group (``nobody``, ``sync`` and
    ``_apt`` share 65534 on Debian). Reproduced before the guard: a 0775 directory of the
    victim's primary group passed as TMPDIR, and an account of that gid renamed the launch
    directory away after its config was written and put its own in place: the worker ran the
    attacker's config. Here the victim is root (gid 0, no listed member) and the attacker uid
    12345 has primary gid 0."""
    _needs_root()
    import tempfile as tempfile_module

    from kvtier.engine import launcher
    from kvtier.worker.config import default_socket_dir

    team = sticky / "team"
    team.mkdir()
    os.chmod(team, 0o775)
    ours = team / "ours"
    ours.mkdir(mode=0o700)
    assert _as_attacker(lambda: os.rename(ours, team / "gone"), gid=0)  # what root made, moved
    os.rmdir(team / "gone")
    group = re.escape("its group root (gid 0)")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(team))
    monkeypatch.setattr(tempfile_module, "tempdir", None)  # read TMPDIR again
    with pytest.raises(ConfigError, match=f"TMPDIR: refusing .*{group} without the sticky bit"):
        launcher._private_directory("attacked")
    with pytest.raises(ConfigError, match=f"TMPDIR: refusing .*{group}"):
        default_socket_dir()
    with pytest.raises(ConfigError, match=f"storage.root: refusing .*{group}"):
        FileStore(SPEC, {"root": team})
    assert list(team.iterdir()) == []
    os.chmod(team, 0o755)  # the group may no longer write: taken
    with FileStore(SPEC, {"root": team / "kv"}):
        pass


def test_a_launched_worker_reads_its_config_from_its_launcher_not_a_file(tmp_path) -> None:
    """Defence in depth for the swap above: the config never lies in a directory, so nothing
    renamed in one can replace it; the worker's command line says ``--config -``."""
    from kvtier.engine.client import Client
    from kvtier.layout.spec import KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_blocks=4, num_kv_heads=1, block_size=16, head_dim=8)
    memory = {"backend": "memory"}
    with Client.launch(spec, 1, memory, device_cache_mode="create", log_dir=tmp_path) as client:
        launch = client._launch
        assert launch is not None and launch.directory is not None
        assert sorted(p.name for p in launch.directory.iterdir()) == [".owner.lock"]
        cmdline = Path(f"/proc/{launch.processes[0].pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--config") + 1] == b"-"
        assert client.ping() > 0


# ---- operator tools: walked like the workers, removals relative to what was scanned -------------


def _filled_store(root: Path, n: int) -> list[str]:
    keys = _victims_keys(n)
    with FileStore(SPEC, {"root": root}) as store, HostPool(SPEC, n) as pool:
        assert store.put_from(keys, [pool.block(i) for i in range(n)]) == [True] * n
    return keys


def test_store_tools_refuse_a_root_another_user_controls(sticky) -> None:
    """Reproduced before the guard: ``kvtier store verify|gc`` listed and unlinked by path on a
    root uid 12345 owned, without the walk the workers use."""
    _needs_root()
    root = sticky / "kv"
    _squat(root, _victims_keys(2))
    before = _tree(root)
    for command in (["verify", "--repair"], ["gc", "--older-than", "0s"], ["stats"]):
        out = subprocess.run(
            [sys.executable, "-m", "kvtier.ops.cli", "store", *command, str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("kvtier: error: root: refusing ") and f"uid {ATTACKER}" in last
        assert "Traceback" not in out.stderr
    assert _tree(root) == before


def test_a_fanout_swapped_for_a_link_after_the_scan_leads_no_removal_outside_the_store(
    tmp_path,
) -> None:
    """Reproduced before the guard: once the scan passed a fan-out, it was swapped for a link
    to another directory holding a file of an object's name, and ``verify --repair`` unlinked
    ``root/objects/<fan>/<name>`` by path: the file outside the store. Now the removal is
    relative to the fan-out directory the scan opened."""
    from kvtier.storage.file.admin import StoreTree, remove

    root = tmp_path / "kv"
    _filled_store(root, 3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with StoreTree(root) as tree:
        objects = [o for o in tree.scan() if not o.foreign]
        victim = objects[0]
        fanout = victim.path.parent
        (elsewhere / victim.path.name).write_bytes(b"not the store's")
        fanout.rename(tmp_path / "moved-fanout")  # what the scan opened, moved away
        fanout.symlink_to(elsewhere)  # and a link in its place
        assert remove(victim)
    assert (elsewhere / victim.path.name).read_bytes() == b"not the store's"
    assert not (tmp_path / "moved-fanout" / victim.path.name).exists()  # the store's, removed
    with pytest.raises(StorageError, match="refusing to remove"):
        remove(dataclasses.replace(victim, foreign=True))
