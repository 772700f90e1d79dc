"""Control requests of a worker: pause, resume, update_weights, sleep, wakeup, stats.

Each handler returns (code, message, data). Repeated calls are idempotent (200, saying so);
an unknown method or bad arguments is 400; a request the current state does not allow is 409;
the worker turns an exception into 500.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier import tasks as t
from kvtier.control import WorkerState
from kvtier.datapath import DataPath
from kvtier.errors import KvtierError
from kvtier.host import HostPool
from kvtier.keys import read_weight_version

if TYPE_CHECKING:
    from kvtier.worker import Worker

Answer = tuple[int, str, dict[str, Any]]
ALLOWED = ", ".join(m.value for m in t.ControlMethod)


def handle(worker: Worker, method: str, args: dict[str, Any]) -> Answer:
    handlers = {
        t.ControlMethod.PAUSE.value: _pause,
        t.ControlMethod.RESUME.value: _resume,
        t.ControlMethod.UPDATE_WEIGHTS.value: _update_weights,
        t.ControlMethod.SLEEP.value: _sleep,
        t.ControlMethod.WAKEUP.value: _wakeup,
        t.ControlMethod.STATS.value: _stats,
    }
    handler = handlers.get(method)
    if handler is None:
        return t.Code.BAD_REQUEST, f"unknown control method {method!r}; allowed: {ALLOWED}", {}
    timeout = args.pop("timeout_s", None)
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        return t.Code.BAD_REQUEST, f"timeout_s must be a positive number, got {timeout!r}", {}
    allowed_args = {"update_weights": {"version"}}.get(method, set())
    unknown = sorted(set(args) - allowed_args)
    if unknown:
        return t.Code.BAD_REQUEST, f"{method} takes no argument {unknown[0]!r}", {}
    return handler(worker, args, timeout or 60.0)


def _drain(worker: Worker, timeout_s: float) -> bool:
    return worker.gate.wait_idle(timeout_s)


def _pause(worker: Worker, args: dict, timeout_s: float) -> Answer:
    state = worker.gate.state
    if state is WorkerState.SLEEPING:
        return t.Code.CONFLICT, "cannot pause while sleeping: wake up first", {}
    if state is WorkerState.PAUSED:
        return t.Code.OK, f"already paused ({worker.gate.held} tasks held)", {}
    worker.gate.set_state(WorkerState.PAUSED)  # from now on new data tasks are held
    if not _drain(worker, timeout_s):
        return (
            t.Code.FAILED,
            f"paused, but {worker.gate.in_flight} tasks still running after {timeout_s:.0f} s",
            {},
        )
    return t.Code.OK, "paused: in-flight tasks finished; new data tasks are held", {}


def _resume(worker: Worker, args: dict, timeout_s: float) -> Answer:
    state = worker.gate.state
    if state is WorkerState.SLEEPING:
        return t.Code.CONFLICT, "cannot resume while sleeping: wake up first", {}
    if state is WorkerState.RUNNING:
        return t.Code.OK, "already running", {}
    note = _reread_version(worker)
    released = worker.gate.resume(worker._submit)
    return (
        t.Code.OK,
        f"resumed; released {released} held tasks in order{note}",
        {"released": released},
    )


def _reread_version(worker: Worker) -> str:
    """Like the old system, resume re-reads version.yaml; a missing file keeps the version."""
    if not worker.config.model_dir:
        return ""
    version = read_weight_version(worker.config.model_dir)
    if version and version != worker.datapath.keys.version:
        worker.datapath.set_version(version)
        return f"; weight version is now {version!r}"
    return ""


def _update_weights(worker: Worker, args: dict, timeout_s: float) -> Answer:
    version = args.get("version")
    if version is None:
        if not worker.config.model_dir:
            return t.Code.BAD_REQUEST, "no version given and no model_dir to read it from", {}
        version = read_weight_version(worker.config.model_dir)
        if not version:  # missing or malformed version.yaml: logged; the version stays
            kept = worker.datapath.keys.version
            return t.Code.OK, f"version.yaml unreadable: weight version stays {kept!r}", {}
    if not isinstance(version, str):
        return t.Code.BAD_REQUEST, f"version must be a string, got {version!r}", {}
    previous = worker.datapath.keys.version
    try:
        worker.datapath.set_version(version)
    except KvtierError as e:
        return t.Code.BAD_REQUEST, str(e), {}
    if previous == version:
        return t.Code.OK, f"weight version already {version!r}", {"version": version}
    return (
        t.Code.OK,
        f"weight version {previous!r} -> {version!r}: older objects can no longer be hit",
        {"version": version},
    )


def _sleep(worker: Worker, args: dict, timeout_s: float) -> Answer:
    if worker.gate.state is WorkerState.SLEEPING:
        return t.Code.OK, "already sleeping", {}
    worker.gate.set_state(WorkerState.PAUSED)
    if not _drain(worker, timeout_s):
        worker.gate.resume(worker._submit)
        return (
            t.Code.FAILED,
            f"{worker.gate.in_flight} tasks still running after {timeout_s:.0f} s: not sleeping",
            {},
        )
    for identity, task in worker.gate.take_held():
        worker._answer(
            identity, task.task_id, t.Status.CANCELLED, "worker went to sleep before this task ran"
        )
    worker.device_cache.detach()
    if worker.config.free_host_pool_on_sleep:
        worker.datapath.close()
        worker.host_pool.close()
    worker.gate.set_state(WorkerState.SLEEPING)
    freed = " and freed the host pool" if worker.config.free_host_pool_on_sleep else ""
    return t.Code.OK, f"sleeping: detached the device cache{freed}", {}


def _wakeup(worker: Worker, args: dict, timeout_s: float) -> Answer:
    if worker.gate.state is not WorkerState.SLEEPING:
        return t.Code.OK, "already awake", {}
    try:
        worker.device_cache.reattach()  # checks the layout against the spec
    except KvtierError as e:
        return t.Code.FAILED, f"cannot re-attach the device cache: {e}", {}
    if worker.config.free_host_pool_on_sleep:
        cfg = worker.config
        worker.host_pool = HostPool(cfg.spec, cfg.num_host_blocks + 2 * cfg.staging_blocks)
        worker.datapath = DataPath(
            worker.device_cache,
            worker.host_pool,
            cfg.num_host_blocks,
            cfg.staging_blocks,
            worker.storage,
            worker.datapath.keys,
        )
    worker.gate.set_state(WorkerState.RUNNING)
    return t.Code.OK, "awake: device cache re-attached", {}


def _stats(worker: Worker, args: dict, timeout_s: float) -> Answer:
    return t.Code.OK, "stats", worker.stats()
