"""Control requests of a worker: pause, resume, update_weights, sleep, wakeup, stats, estimates.

A request is handled in two parts. At receipt, on the worker's loop thread and in message
order, it does what orders it against data tasks: ``pause``/``sleep`` start holding new data
tasks, ``update_weights`` and ``resume`` switch the weight version that tasks arriving after
them are stamped with. What may block (waiting for in-flight tasks, detaching and re-attaching
memory, releasing held tasks) runs afterwards on one control thread, in arrival order.

Answers: 200 (repeated calls are idempotent and say so), 400 for an unknown method or bad
arguments, 409 for a request the current state does not allow, 500 when a handler fails.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KvtierError
from kvtier.transport.tasks import Code, Control, ControlMethod, Status
from kvtier.worker.gate import Gate, WorkerState
from kvtier.worker.resources import RankResources, VersionChange

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0  # pause/sleep wait this long for in-flight tasks unless told otherwise
ALLOWED = ", ".join(m.value for m in ControlMethod)
ARGUMENTS = {ControlMethod.UPDATE_WEIGHTS: {"version", "allow_rollback"}}
MAX_ESTIMATES = 32  # names an ``estimates`` request may carry (a tier chain's, with room)
ESTIMATE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass
class Answer:
    code: Code
    message: str
    data: dict[str, Any] = field(default_factory=dict)


Deferred = Callable[[], Answer]


class ControlPlane:
    """Runs control requests against one rank's Gate and RankResources."""

    def __init__(
        self,
        resources: RankResources,
        gate: Gate,
        *,
        submit: Callable[[Any], None],
        reply: Callable[[bytes, Control, Answer], None],
        cancel: Callable[[Any, str], None],
        stats: Callable[[], dict[str, Any]],
        rank: int,
    ) -> None:
        self.resources = resources
        self.gate = gate
        self._submit = submit  # (peer, task, keys) -> executor
        self._reply = reply
        self._cancel = cancel  # answer a held item "cancelled" with a reason
        self._stats = stats
        self.rank = rank
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-control")
        # The engine's load-or-recompute estimates, as its last ``estimates`` request gave them
        # (name -> seconds; read by the exporter and ``stats`` from other threads: replaced whole)
        self.estimates: dict[str, float] = {}

    def receive(self, peer: bytes, task: Control) -> None:
        """Loop thread: the ordering part now; the rest, if any, on the control thread."""
        try:
            result = self._begin(task)
        except Exception as e:  # a bug: answered 500, logged with its traceback
            log.exception("rank %d: control %s failed", self.rank, task.method)
            result = Answer(Code.FAILED, f"{task.method} failed: {type(e).__name__}: {e}")
        if isinstance(result, Answer):
            self._finish(peer, task, result)
        else:
            self._executor.submit(self._run_deferred, peer, task, result)

    def _run_deferred(self, peer: bytes, task: Control, deferred: Deferred) -> None:
        try:
            answer = deferred()
        except Exception as e:
            log.exception("rank %d: control %s failed", self.rank, task.method)
            answer = Answer(Code.FAILED, f"{task.method} failed: {type(e).__name__}: {e}")
        self._finish(peer, task, answer)

    def _finish(self, peer: bytes, task: Control, answer: Answer) -> None:
        quiet = task.method == ControlMethod.ESTIMATES.value and answer.code == Code.OK
        log.log(  # estimates come every second: not a line each
            logging.DEBUG if quiet else logging.INFO,
            "rank %d: control %s -> %d %s",
            self.rank,
            task.method,
            answer.code,
            answer.message,
        )
        self._reply(peer, task, answer)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def snapshot(self) -> dict[str, Any]:
        """What ``stats`` answers and the exporter shows: the worker's stats and, once the
        engine sent them, its estimates."""
        estimates = self.estimates
        return {**self._stats(), **({"estimates": dict(estimates)} if estimates else {})}

    # ---- dispatch ---------------------------------------------------------------------------

    def _begin(self, task: Control) -> Answer | Deferred:
        try:
            method = ControlMethod(task.method)
        except ValueError:
            return Answer(
                Code.BAD_REQUEST, f"unknown control method {task.method!r}; allowed: {ALLOWED}"
            )
        args = dict(task.args)
        timeout = args.pop("timeout_s", None)
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            return Answer(Code.BAD_REQUEST, f"timeout_s must be a positive number, got {timeout!r}")
        if method is ControlMethod.ESTIMATES:
            return self._estimates(args)
        unknown = sorted(set(args) - ARGUMENTS.get(method, set()))
        if unknown:
            return Answer(Code.BAD_REQUEST, f"{method.value} takes no argument {unknown[0]!r}")
        drain_s = float(timeout or DRAIN_TIMEOUT_S)
        match method:
            case ControlMethod.PAUSE:
                return self._pause(drain_s)
            case ControlMethod.RESUME:
                return self._resume()
            case ControlMethod.UPDATE_WEIGHTS:
                return self._update_weights(args.get("version"), args.get("allow_rollback", False))
            case ControlMethod.SLEEP:
                return self._sleep(drain_s)
            case ControlMethod.WAKEUP:
                return self._wakeup()
            case ControlMethod.STATS:
                return Answer(Code.OK, "stats", self.snapshot())
        raise AssertionError(method)

    # ---- handlers ---------------------------------------------------------------------------

    def _estimates(self, args: dict[str, Any]) -> Answer:
        if len(args) > MAX_ESTIMATES:
            return Answer(Code.BAD_REQUEST, f"estimates: at most {MAX_ESTIMATES} names")
        for name, value in args.items():
            if not ESTIMATE_NAME.fullmatch(name):
                return Answer(Code.BAD_REQUEST, f"estimates: bad name {name[:64]!r}")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                return Answer(Code.BAD_REQUEST, f"estimates: {name} must be seconds >= 0")
        self.estimates = {name: float(value) for name, value in args.items()}
        return Answer(Code.OK, f"{len(args)} estimates")

    def _pause(self, drain_s: float) -> Answer | Deferred:
        state = self.gate.state
        if state is WorkerState.SLEEPING:
            return Answer(Code.CONFLICT, "cannot pause while sleeping: wake up first")
        if state is WorkerState.PAUSED:
            return Answer(Code.OK, f"already paused ({self.gate.held} tasks held)")
        self.gate.set_state(WorkerState.PAUSED)  # from now on new data tasks are held

        def drain() -> Answer:
            if not self.gate.wait_idle(drain_s):
                return Answer(
                    Code.FAILED,
                    f"paused, but {self.gate.in_flight} tasks still running after {drain_s:.0f} s",
                )
            return Answer(Code.OK, "paused: in-flight tasks finished; new data tasks are held")

        return drain

    def _resume(self) -> Answer | Deferred:
        state = self.gate.state
        if state is WorkerState.SLEEPING:
            return Answer(Code.CONFLICT, "cannot resume while sleeping: wake up first")
        if state is WorkerState.RUNNING:
            return Answer(Code.OK, "already running")
        note = _describe(self.resources.reread_version(), "re-read version.yaml")

        def release() -> Answer:
            released = self.gate.resume(self._submit)
            return Answer(
                Code.OK,
                f"resumed; released {released} held tasks in order{note}",
                {"released": released},
            )

        return release

    def _update_weights(self, version: Any, allow_rollback: Any) -> Answer:
        """An explicit version pins; none re-reads version.yaml (the trainer's word: a rollback
        there is taken as it is). An explicit rollback — a version in force before, or an
        earlier RL-STEP, or the empty version (KV stored before any version was set) — makes
        old KV hittable again, so it needs ``allow_rollback=true`` (else 409)."""
        if version is not None and not isinstance(version, str):
            return Answer(Code.BAD_REQUEST, f"version must be a string, got {version!r}")
        if not isinstance(allow_rollback, bool):
            return Answer(
                Code.BAD_REQUEST, f"allow_rollback must be true or false, got {allow_rollback!r}"
            )
        if version is None and not self.resources.config.model_dir:
            return Answer(Code.BAD_REQUEST, "no version given and no model_dir to read it from")
        versions = self.resources.versions
        rollback = version is not None and (
            versions.is_rollback(version) or (version == "" != versions.keys.version)
        )
        if rollback and not allow_rollback:
            what = (
                "the empty version names KV stored before any version was set"
                if version == ""
                else f"{version!r} is a rollback from {versions.keys.version!r}"
            )
            return Answer(
                Code.CONFLICT,
                f"{what}: KV stored under it would be hit again; pass allow_rollback=true if "
                "the weights are that version",
            )
        try:
            change = self.resources.update_version(version)
        except KvtierError as e:
            return Answer(Code.BAD_REQUEST, str(e))
        current = self.resources.keys.version
        if change is None:  # missing or malformed version.yaml: logged; the version stays
            return Answer(Code.OK, f"version.yaml unreadable: weight version stays {current!r}")
        pin = "" if version is None else " (pinned: resume will not re-read version.yaml)"
        data = {"version": current, "pinned": self.resources.versions.pinned}
        if not change.changed:
            return Answer(Code.OK, f"weight version already {current!r}{pin}", data)
        return Answer(Code.OK, _describe(change, "update_weights").lstrip("; ") + pin, data)

    def _sleep(self, drain_s: float) -> Answer | Deferred:
        if self.gate.state is WorkerState.SLEEPING:
            return Answer(Code.OK, "already sleeping")
        self.gate.set_state(WorkerState.PAUSED)

        def go_to_sleep() -> Answer:
            if not self.gate.wait_idle(drain_s):
                self.gate.resume(self._submit)
                return Answer(
                    Code.FAILED,
                    f"{self.gate.in_flight} tasks still running after {drain_s:.0f} s: "
                    "not sleeping",
                )
            for item in self.gate.take_held():
                self._cancel(item, "worker went to sleep before this task ran")
            what = self.resources.sleep()
            self.gate.set_state(WorkerState.SLEEPING)
            return Answer(Code.OK, f"sleeping: {what}")

        return go_to_sleep

    def _wakeup(self) -> Deferred:
        if self.gate.state is WorkerState.SLEEPING:
            self.gate.set_state(WorkerState.WAKING)  # hold data tasks until re-attached

        def wake() -> Answer:
            if self.gate.state not in (WorkerState.SLEEPING, WorkerState.WAKING):
                return Answer(Code.OK, "already awake")
            try:
                self.resources.wakeup()  # checks the layout against the spec
            except KvtierError as e:
                self.gate.set_state(WorkerState.SLEEPING)
                for item in self.gate.take_held():
                    self._cancel(item, f"wakeup failed: {e}")
                return Answer(Code.FAILED, f"cannot re-attach the device cache: {e}")
            released = self.gate.resume(self._submit)
            held = f"; released {released} held tasks" if released else ""
            return Answer(Code.OK, f"awake: device cache re-attached{held}")

        return wake


def _describe(change: VersionChange | None, source: str) -> str:
    if change is None or not change.changed:
        return ""
    text = f"; weight version {change.previous!r} -> {change.current!r} ({source})"
    if change.seen_before:
        return text + f": objects stored under {change.current!r} earlier can be hit again"
    return text + ": older objects can no longer be hit"


__all__ = ["Answer", "ControlPlane", "Status"]
