"""What a stopped ``vllm serve`` leaves that is vLLM's own, and stopping servers the way users do.

Measured on vLLM 0.32 CPU, with and without kvtier: a server at TP=2 leaves its CPU
communicator's shared memory (``vllm_dist_<id>-*``, 16 MiB) even when stopped with Ctrl-C, and a
SIGKILLed server its message queues' (``psm_*``, Python's shared_memory, and their ``sem.mp-*``
semaphores). kvtier's own objects are never among these (``Server.leftovers`` checks those).

Only a server's own are named: ``<id>`` is the name of vLLM's rendezvous file, which lies in the
server's private TMPDIR and which its log prints (``distributed_init_method=file://...``); the
queues' are mapped by the server's process tree.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.memory.shm import SHM_DIR

if TYPE_CHECKING:
    from kvtier_bench.vllm_server import Server

QUEUE_PREFIXES = ("psm_", "sem.mp-")  # vLLM's message queues and their semaphores


def vllm_shm_of(tmpdir: Path, log: str, pids: Iterable[int]) -> set[Path]:
    """vLLM's /dev/shm objects of the server whose TMPDIR is ``tmpdir``, whose log is ``log``
    and whose processes are ``pids``."""
    names: set[Path] = set()
    rendezvous = re.escape(f"file://{tmpdir}/")
    for ident in set(re.findall(rendezvous + r"(vllm_dist_[0-9a-f]+)\b", log)):
        names.update(SHM_DIR.glob(f"{ident}-*"))
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)  # address perms offset dev inode [path]
            path = fields[5] if len(fields) == 6 else ""
            name = path.removeprefix(f"{SHM_DIR}/")
            if name != path and name.startswith(QUEUE_PREFIXES):
                names.add(Path(path.removesuffix(" (deleted)")))
    return names


def remove(paths: set[Path]) -> list[str]:
    """Unlink those of ``paths`` still there; their names."""
    removed = []
    for path in sorted(paths):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    return removed


def stop_all(servers: Iterable[Server]) -> None:
    """Stop every server still running as Ctrl-C in its terminal does, all at once, then end
    anything they started that is left (SIGKILLed, vLLM leaves its queues' shared memory). A
    server that ignores Ctrl-C is SIGKILLed and its ``TimeoutError`` raised after the rest."""
    servers = list(servers)
    running = [s for s in servers if s.process is not None and s.process.poll() is None]
    errors: list[BaseException] = []
    if running:
        with ThreadPoolExecutor(len(running)) as pool:
            for future in [pool.submit(s.stop, "group", signal.SIGINT) for s in running]:
                error = future.exception()
                if error is not None:
                    errors.append(error)
    for server in servers:
        server.kill_marked()
    if errors:
        raise errors[0]
