"""EngineWatch: when a worker should give up on its engine (silence, a dead launcher).

Silence counts from the first accepted hello (before it, only ``start_timeout_s`` bounds the
wait: the engine may take long to start), and only while the worker's own loop runs: a stall of
this process (an overloaded machine) is logged, and the engine's silence during it — when the
worker could not listen — is not held against the engine.
"""

from __future__ import annotations

import logging
import os
import time

from kvtier.worker.config import WorkerConfig

log = logging.getLogger("kvtier.worker.loop")

STALL_S = 2.0  # the loop not running this long: a stall of this process, logged


class EngineWatch:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.greeted = False  # an engine's hello was accepted: silence counts from then
        self._last_heard = self._last_turn = time.monotonic()

    def heard(self, hello: bool = False) -> None:
        """A message from the engine (``hello``: an accepted engine hello)."""
        self._last_heard = time.monotonic()
        self.greeted = self.greeted or hello

    def restart(self) -> None:
        """The worker starts serving now: the start-up bound counts from here."""
        self._last_heard = self._last_turn = time.monotonic()

    def gone(self) -> str:
        """Called once per loop turn: why the worker should exit now ("" if it should not)."""
        now = time.monotonic()
        if now - self._last_turn > STALL_S:
            log.warning(
                "rank %d: the worker's loop did not run for %.1f s",
                self.config.rank,
                now - self._last_turn,
            )
            self._last_heard = max(self._last_heard, now)
        self._last_turn = now
        silent = now - self._last_heard
        if not self.greeted:  # still starting: the engine may take long to say hello
            if silent > self.config.start_timeout_s:
                return (
                    f"no engine said hello within {silent:.1f} s of serving "
                    f"(start_timeout_s={self.config.start_timeout_s:.1f})"
                )
        elif silent > self.config.engine_timeout_s:
            return (
                f"nothing from the engine for {silent:.1f} s "
                f"(engine_timeout_s={self.config.engine_timeout_s:.1f})"
            )
        parent = self.config.parent_pid
        if parent is not None and os.getppid() != parent:
            return f"the engine process {parent} that launched this worker is gone"
        return ""
