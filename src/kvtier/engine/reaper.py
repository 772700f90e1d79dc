"""The reaper: what a launch leaves is removed even when its launcher is killed with its tree.

vLLM ends its worker processes by SIGKILLing every descendant (``kill_process_tree``): the
kvtier worker a vLLM worker launched dies with it, before it can remove its socket, and nobody
removes the device cache segment or the launch directory until the next kvtier start. So a
launch made with ``reaper=True`` also starts this small process, which leaves the launcher's
process tree and session at once (a double fork, then ``setsid``): no signal to the tree or
the terminal's process group reaches it.

It waits on the launcher's pidfd. When the launcher is gone — exited, SIGKILLed, whatever the
way — it waits (bounded) for the launched workers to end, then removes what the dead left:
shared-memory files whose owner is gone, sockets and locks of dead workers, launch directories
whose launcher is dead (``kvtier.worker.orphans.reclaim_orphans``, the sweep every start runs). A
launch that ends cleanly (``Launch.remove_directory``) stops its reaper with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

WORKERS_EXIT_S = 10.0  # after the launcher is gone, workers get this long to exit on their own
# The reaper reports its pid within this: it imports nothing heavy (well under a second on a
# quiet machine), generous for one at load 10. Past it the launch runs without a reaper.
START_TIMEOUT_S = 30.0


def start(launcher_pid: int, worker_pids: Sequence[int]) -> int:
    """Start a reaper for this launch; returns its pid (it is not our child)."""
    command = [sys.executable, "-c", "from kvtier.engine.reaper import main; main()"]
    intermediate = subprocess.Popen(
        [*command, str(launcher_pid), *map(str, worker_pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = intermediate.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        intermediate.kill()
        intermediate.wait()
        raise OSError("the kvtier reaper did not start") from None
    words = out.split()
    if not words or not words[0].isdigit():
        raise OSError("the kvtier reaper did not report its pid")
    return int(words[0])


def stop(pid: int) -> None:
    """A launch that ended cleanly: its reaper has nothing to do."""
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    launcher, *workers = (int(a) for a in sys.argv[1:])
    if os.fork():  # the intermediate: report the reaper's pid, and go
        return
    os.setsid()
    print(os.getpid(), flush=True)
    os.close(1)
    os.open(os.devnull, os.O_WRONLY)  # fd 1 again: nothing holds the launcher's pipe
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _wait_gone([launcher], None)
    _wait_gone(workers, WORKERS_EXIT_S)
    from kvtier.worker.orphans import reclaim_orphans

    reclaim_orphans()
    os._exit(0)


def _wait_gone(pids: Sequence[int], timeout_s: float | None) -> None:
    """Until every pid has exited (or ``timeout_s``)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # gone already
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    remaining = set(fds)
    while remaining:
        wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        events = poller.poll(wait_ms)
        if not events:
            break  # timed out
        for fd, _ in events:
            poller.unregister(fd)
            remaining.discard(fd)
    for fd in fds:
        os.close(fd)
