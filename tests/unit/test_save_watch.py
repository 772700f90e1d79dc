"""SaveWatch: a save blocked on its store is told from one that computes or waits for a core."""

from __future__ import annotations

import threading
import time

from kvtier.worker.save_watch import SHED_AFTER_S, SaveWatch


def _save(watch: SaveWatch, nbytes: int, work, seen: list[float]) -> None:
    """A 'save' on its own thread: ``work`` runs while the watch is asked from this one."""
    done = threading.Event()

    def run() -> None:
        watch.started(nbytes)
        work(done)
        watch.finished()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + SHED_AFTER_S + 0.6
    while time.monotonic() < deadline:
        seen.append(watch.slow_store())
        time.sleep(0.05)
    done.set()
    thread.join()
    seen.append(watch.slow_store())


def test_a_save_blocked_on_its_store_is_slow_one_computing_or_big_is_not() -> None:
    watch = SaveWatch()
    blocked: list[float] = []
    _save(watch, 1 << 20, lambda done: done.wait(), blocked)  # waits, as on a slow link
    assert max(blocked) >= SHED_AFTER_S and blocked[-1] == 0.0  # answered: nothing runs

    def spin(done: threading.Event) -> None:  # on a CPU, or waiting for one: not the store
        while not done.is_set():
            sum(range(1000))

    computing: list[float] = []
    _save(watch, 1 << 20, spin, computing)
    assert max(computing) == 0.0

    big: list[float] = []  # 1 GiB blocked ~1.6 s: 640 MB/s, a sound store
    _save(watch, 1 << 30, lambda done: done.wait(), big)
    assert max(big) == 0.0
