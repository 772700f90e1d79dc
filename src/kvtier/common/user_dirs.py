"""Directories at paths the user chose, made and opened only where nobody else controls them.

A file store root, a log directory or ``--keep-store`` is often in a shared place (``/tmp/kv``,
``/dev/shm/kv``, a scratch disk). If it does not exist yet, any local user can create it first
and then decides what kvtier loads from it (a planted object with a valid checksum) and deletes
what kvtier stores. So, as OpenSSH's StrictModes does for keys, every component of the path is
walked from ``/`` through descriptors and checked on the descriptor before the next one is
opened or made:

- a directory must belong to this user or root (a shared store's root and its parents may
  instead belong to a group of this user, the store's documented sharing);
- "others may write" is read from the mode bits *and* the POSIX ACL on the descriptor (a named
  user, or a group not shared on purpose, that the ACL mask lets write); group write counts as
  others' write except on a group store's path: a user's primary group is never trusted, since
  accounts sharing a primary gid are not listed in ``/etc/group`` (``nobody``, ``sync`` and
  ``_apt`` share 65534 on Debian);
- one that others may write to must have the sticky bit (``/tmp``), so that nobody can rename
  what is inside; the final directory must not be writable by others at all, nor hand others
  write on what is made in it (a default ACL);
- a symbolic link is followed only if this user or root made it.

Nothing is read or written inside a directory before it passed.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import struct
from pathlib import Path

from kvtier.errors import ConfigError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # Linux's own bound on links followed while resolving one path
ACL_ACCESS, ACL_DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
# Tags of a POSIX ACL entry as the kernel stores it in the xattr (linux/posix_acl_xattr.h).
ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK = 0x02, 0x04, 0x08, 0x10
ACL_WRITE = 0x02


def open_user_directory(
    path: Path | str,
    mode: int,
    field: str,
    *,
    group_shared: bool = False,
    parent: bool = False,
    make: bool = True,
) -> tuple[int, bool]:
    """A descriptor of the directory ``path`` (made with ``mode`` where missing, parents too),
    and whether its last component was made here. Raises ``ConfigError`` naming ``field`` when
    a component is controlled by another user (see the module's rules). ``parent``: ``path``
    is where kvtier makes its own private names (``TMPDIR``): it is checked as a parent (a
    sticky ``/tmp`` is fine) and never made. ``make=False``: a missing component is refused
    (an existing store an operator's tool works on)."""
    wanted = Path(os.path.abspath(os.path.expanduser(path)))
    checker = _Checker(wanted, field, group_shared, parent)
    names = list(wanted.parts[1:])
    fd = os.open("/", DIR_FLAGS)
    at, made, links = Path("/"), False, 0
    try:
        checker.check(fd, at, last=not names)
        while names:
            name = names.pop(0)
            if name in ("", "."):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if parent or not make:
                    raise ConfigError(field, f"{at / name} does not exist") from None
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                    made = not names
                except FileExistsError:
                    pass  # made meanwhile (another rank): checked as found
                names.insert(0, name)
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                checker.check_link(st, at / name, links)
                target = Path(os.readlink(name, dir_fd=fd))
                names = [*target.parts[target.is_absolute() :], *names]
                if target.is_absolute():
                    os.close(fd)
                    fd, at = os.open("/", DIR_FLAGS), Path("/")
                made = False
                continue
            child = _open_directory(fd, name, at, field)
            os.close(fd)
            fd = child
            at = at.parent if name == ".." else at / name
            checker.check(fd, at, last=not names)
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def _open_directory(fd: int, name: str, at: Path, field: str) -> int:
    """The directory ``name`` in ``fd`` (``at``), never through a link."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise ConfigError(field, f"{at / name} is not a directory") from None
        raise


def check_parent_directory(path: Path | str, field: str) -> None:
    """Refuse (``ConfigError``) a directory where kvtier is about to make private names of its
    own (``mkdtemp``, a socket directory) if another user could rename them."""
    os.close(open_user_directory(path, 0o700, field, parent=True)[0])


def make_user_directory(path: Path | str, mode: int, field: str) -> Path:
    """``open_user_directory`` for a caller that opens files in it by path (log files)."""
    fd, made = open_user_directory(path, mode, field)
    try:
        if made:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return Path(os.path.abspath(os.path.expanduser(path)))


class _Checker:
    def __init__(self, wanted: Path, field: str, group_shared: bool, parent: bool) -> None:
        self.wanted, self.field, self.group_shared = wanted, field, group_shared
        self.parent = parent  # the last component is checked as a parent too
        self.uid = os.geteuid()
        self.groups = {os.getegid(), *os.getgroups()}

    def check(self, fd: int, at: Path, last: bool) -> None:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        last = last and not self.parent
        ours = st.st_uid in (self.uid, 0)
        group_ok = self.group_shared and st.st_gid in self.groups and not mode & 0o002
        if not ours and not group_ok:
            self._refuse(
                at,
                f"belongs to {_user(st.st_uid)}, not to you"
                + (" (another user made it first and decides what it holds)" if last else ""),
            )
        writers = self._writers(fd, st, ACL_ACCESS, last)
        if last and writers:
            self._refuse(at, f"is writable by {writers}")
        if not last and writers and not mode & stat.S_ISVTX:
            self._refuse(
                at,
                f"is writable by {writers} without the sticky bit (anyone may rename what is "
                "inside)",
            )
        if last and (inherited := self._writers(fd, st, ACL_DEFAULT, last)):
            self._refuse(at, f"has a default ACL that lets {inherited} write what is made in it")

    def _writers(self, fd: int, st: os.stat_result, which: str, last: bool) -> str:
        """Who other than this user (and a group store's own groups) may write to the directory
        (``which``: its access ACL and mode bits) or what is made in it (its default ACL), in
        words; empty when nobody."""
        entries = _acl_entries(fd, which)
        if which == ACL_DEFAULT and not entries:
            return ""
        mask = next((perm for tag, perm, _ in entries if tag == ACL_MASK), None)
        if which == ACL_ACCESS and st.st_mode & 0o002:
            return "others"  # everyone: naming some of them would add nothing
        found = []
        group_perm = next((p for t, p, _ in entries if t == ACL_GROUP_OBJ), None)
        if group_perm is None:  # no ACL: the group bits are the owning group's
            group_perm = (st.st_mode >> 3) & 0o7
        if _effective(group_perm, mask) and not self._trusted_group(st.st_gid, st.st_gid, last):
            found.append(f"its group {_group(st.st_gid)}")
        for tag, perm, qualifier in entries:
            if not _effective(perm, mask):
                continue
            if tag == ACL_USER and qualifier not in (self.uid, 0):
                found.append(f"{_user(qualifier)} through an ACL")
            elif tag == ACL_GROUP and not self._trusted_group(qualifier, st.st_gid, last):
                found.append(f"group {_group(qualifier)} through an ACL")
        return ", ".join(found)

    def check_link(self, st: os.stat_result, at: Path, links: int) -> None:
        if links > MAX_LINKS:
            self._refuse(at, "has too many levels of symbolic links")
        if st.st_uid not in (self.uid, 0):
            self._refuse(at, f"is a symbolic link made by {_user(st.st_uid)}")

    def _trusted_group(self, gid: int, owning_gid: int, last: bool) -> bool:
        """A group allowed to write, only ever on a store shared with its group on purpose:
        the store root's own group (whoever its members: that is the sharing), or a group of
        this user's. Never otherwise, not even a primary group with no listed member: accounts
        whose primary gid it is are not listed in /etc/group."""
        if not self.group_shared:
            return False
        return gid in self.groups or (last and gid == owning_gid)

    def _refuse(self, at: Path, why: str) -> None:
        where = "" if at == self.wanted else f" (on the way to {self.wanted})"
        raise ConfigError(
            self.field,
            f"refusing {at}{where}: it {why}. Choose a directory of your own (for example "
            "under your home directory), or have it removed or fixed by its owner or root",
        )


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _effective(perm: int, mask: int | None) -> bool:
    return bool(perm & ACL_WRITE and (mask is None or mask & ACL_WRITE))


def _acl_entries(fd: int, which: str) -> list[tuple[int, int, int]]:
    """The entries (tag, permissions, uid or gid) of the directory's POSIX ACL ``which``; none
    when it has no extended ACL or the filesystem keeps none."""
    try:
        raw = os.getxattr(fd, which)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return []
        raise
    if len(raw) < 4 or (len(raw) - 4) % 8 or struct.unpack_from("<I", raw)[0] != 2:
        raise OSError(errno.EINVAL, f"an ACL in an unknown format ({len(raw)} bytes)")
    return [struct.unpack_from("<HHI", raw, offset) for offset in range(4, len(raw), 8)]
