"""Which cores a worker runs on: Linux CPU lists (``"1,4-6"``), read, written and applied."""

from __future__ import annotations

import logging
import os

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

# vLLM's OpenMP binding, inherited from a vLLM worker: it would bind kvtier's own OpenMP threads
# (torch's) to vLLM's compute cores, whatever the worker's affinity says.
OMP_PLACEMENT_VARIABLES = ("OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")


def parse_cpu_list(text: str, field: str = "cpu_cores") -> frozenset[int]:
    """``"0,2-3"`` -> {0, 2, 3}; a ConfigError naming ``field`` otherwise."""
    cores: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ConfigError(field, f"{text!r} is not a CPU list like '1' or '0,2-3'") from None
        if first < 0 or last < first or last > 65535:
            raise ConfigError(field, f"{text!r}: bad range {part!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ConfigError(field, f"{text!r} names no core")
    return frozenset(cores)


def format_cpu_list(cores: set[int] | frozenset[int]) -> str:
    """{0, 2, 3} -> ``"0,2-3"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive cores
    for core in sorted(cores):
        if runs and runs[-1][1] == core - 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def run_on(cpu_cores: str | None) -> None:
    """Move this process — every thread it has (imports start some) and, by inheritance, every
    thread it starts later — to ``cores``; a warning, not a failure, where the system refuses
    (a cpuset without them). None: stay where it started. Either way, then ``fit_threads``."""
    if cpu_cores is not None:
        _move_to(parse_cpu_list(cpu_cores))
    fit_threads()


def _move_to(cores: frozenset[int]) -> None:
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except OSError as e:
        log.warning(
            "cannot run on cores %s (%s): staying on %s",
            format_cpu_list(cores),
            e,
            format_cpu_list(frozenset(os.sched_getaffinity(0))),
        )


def fit_threads() -> None:
    """At most as many torch threads as this process has cores (kvtier's parallel copies start
    as many). A worker started from a vLLM worker inherits its ``OMP_NUM_THREADS`` — that rank's
    compute cores, 32 on a large server — while it runs on the one or two cores vLLM reserved."""
    import torch

    cores = len(os.sched_getaffinity(0))
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
