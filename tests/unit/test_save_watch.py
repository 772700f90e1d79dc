"""SaveWatch: a save blocked on its store is told from one that computes or waits for a core."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from kvtier.worker.save_watch import SHED_AFTER_S, SaveWatch, core_wait_s


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


def test_a_saves_waits_for_a_core_are_told_apart_from_its_store() -> None:
    """``finished()`` returns the seconds the save's thread waited on a run queue: with a
    busy process pinned to the same core a spinning save waits for about half of its time;
    a save that waits on its store (not runnable) waits for no core."""
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [sys.executable, "-c", "import sys; print(flush=True); sys.stdout.close()\nwhile 1: pass"],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline() == b"\n"  # spinning from now
        watch, waits = SaveWatch(), {}

        def save(name: str, work) -> None:
            os.sched_setaffinity(threading.get_native_id(), {core})
            before = core_wait_s()
            watch.started(1 << 20)
            work()
            waits[name] = watch.finished()
            after = core_wait_s()  # what a load's task measures around itself
            assert before is not None and after is not None
            waits[f"{name} (core_wait_s)"] = after - before

        def spin() -> None:  # 0.6 s of wall time, sharing the core with the hog
            until = time.monotonic() + 0.6
            while time.monotonic() < until:
                pass

        for name, work in (("spin", spin), ("store", lambda: time.sleep(0.6))):
            thread = threading.Thread(target=save, args=(name, work))
            thread.start()
            thread.join()
    finally:
        hog.kill()
        hog.wait()
    assert waits["spin"] >= 0.15, waits  # ~0.3 s: the core is shared with one busy process
    assert waits["store"] < 0.05, waits
    assert waits["spin (core_wait_s)"] >= waits["spin"] and waits["store (core_wait_s)"] < 0.05
