"""Cleanup that an interrupt cannot cut short, and helpers that die with their starter.

Ctrl-C or SIGTERM arriving while kvtier removes what it made (a worker's socket, a launch
directory, a temporary store) used to stop the removal half way and leave the rest behind.
Inside ``deferred_interrupts`` the main thread notes such a signal instead, and raises it when
the block ends; the cleanup blocks are short (they end processes and unlink files), so the
interrupt still ends the program within about a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL this child when the thread that started it exits (Linux), so a
    helper server (a Mooncake master, an S3 server) never outlives a SIGKILLed starter."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT / SIGTERM until the block ends, then deliver the first one that came."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread
        return
    pending: list[int] = []
    try:
        previous = {s: signal.signal(s, lambda signum, _: pending.append(signum)) for s in SIGNALS}
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])


class CleanupStack(contextlib.ExitStack):
    """An ExitStack whose unwinding runs with interrupts deferred (see the module docstring)."""

    def __exit__(self, *exc: Any) -> bool:
        with deferred_interrupts():
            return bool(super().__exit__(*exc))
