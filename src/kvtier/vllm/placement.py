"""Where this rank's kvtier worker runs: on the cores vLLM reserved, not on its compute cores.

vLLM on CPU binds each worker's OpenMP threads to a list of cores (``OMP_PLACES`` and friends,
from ``VLLM_CPU_OMP_THREADS_BIND``, auto: one NUMA node per rank) and keeps some cores out of
those lists: one per rank for its scheduler, and — when a KV connector is configured — one more
per rank for the connector (``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides the count). A kvtier
worker started from a vLLM worker would otherwise inherit the OpenMP master thread's affinity:
vLLM's first compute core, where every copy it makes stalls a parallel region.

The rule, with vLLM's automatic binding: the cores this process may use, on the NUMA nodes of
this rank's compute cores, minus every rank's compute cores — the cores vLLM reserved. Where it
reserved none (2 cores: the 2 it wants to reserve leave nothing), the worker runs on all allowed
cores and its save threads at a lower priority; the log line says how to reserve one.

With an explicit ``VLLM_CPU_OMP_THREADS_BIND`` vLLM reserves nothing, and the cores outside the
lists are often another server's: several vLLM instances on one host, each bound to its own
cores, or a prefill and a decode instance side by side. A vLLM worker spin-waits on its cores
for a second after every step (``sched_yield``), and a kvtier worker placed there waited up to a
second for the CPU on every request (measured: a P/D consumer's TTFT 1.04 s instead of 0.07 s,
the producer's 1.03 s instead of 0.5 s). So there the worker runs on this rank's own cores; a
core left free for it is named with the ``worker_cores`` setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.common.cpus import format_cpu_list, parse_cpu_list
from kvtier.errors import ConfigError

NUMA_ROOT = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class Placement:
    cores: frozenset[int]  # where the kvtier worker runs
    reserved: bool  # on cores vLLM keeps free of compute; False: shared with vLLM's threads
    note: str  # one line for the log


def omp_cores(environ: Mapping[str, str]) -> frozenset[int]:
    """This process's OpenMP compute cores, as vLLM set them (empty: not bound, or in a form
    vLLM does not write)."""
    try:
        for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY"):
            text = environ.get(name, "").strip("{} ").replace("},{", ",").replace(" ", ",")
            if text:
                return _cpu_list(text)
        affinity = environ.get("KMP_AFFINITY", "")
        if "proclist=[" in affinity:
            return _cpu_list(affinity.split("proclist=[", 1)[1].split("]", 1)[0])
    except ConfigError:
        pass
    return frozenset()


def bound_elsewhere(environ: Mapping[str, str]) -> frozenset[int]:
    """Every rank's compute cores where the user listed them (``VLLM_CPU_OMP_THREADS_BIND``)."""
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind", ""):
        return frozenset()
    try:
        return frozenset().union(*(_cpu_list(part) for part in bind.split("|") if part))
    except ConfigError:
        return frozenset()


def numa_nodes(root: Path = NUMA_ROOT) -> list[frozenset[int]]:
    nodes = []
    for path in sorted(root.glob("node[0-9]*/cpulist")):
        try:
            nodes.append(_cpu_list(path.read_text().strip()))
        except (OSError, ConfigError):
            continue
    return nodes


def choose(
    allowed: frozenset[int],
    compute: frozenset[int],
    other_compute: frozenset[int],
    nodes: list[frozenset[int]],
    explicit: bool = False,
) -> Placement:
    """The rule above, as a pure function of what the system says (``explicit``: the user
    listed the compute cores in ``VLLM_CPU_OMP_THREADS_BIND``)."""
    if not compute:
        return Placement(allowed, False, "vLLM did not bind its threads: no placement needed")
    if explicit:
        return Placement(
            compute,
            False,
            f"on this rank's core(s) {format_cpu_list(compute)}: VLLM_CPU_OMP_THREADS_BIND lists "
            "the cores, so vLLM reserved none and the others may be another server's; name a "
            "free core with the worker_cores setting",
        )
    local = frozenset().union(*(n for n in nodes if n & compute)) if nodes else allowed
    free = (allowed & (local or allowed)) - compute - other_compute
    if free:
        return Placement(
            free,
            True,
            f"on core(s) {format_cpu_list(free)}, which vLLM reserved (its compute: "
            f"{format_cpu_list(compute)})",
        )
    return Placement(
        allowed,
        False,
        f"vLLM reserved no core here (compute on {format_cpu_list(compute)}): the kvtier worker "
        "shares all cores, its saves at a lower priority; VLLM_CPU_NUM_OF_RESERVED_CPU=1 keeps "
        "one for it",
    )


def for_this_rank(environ: Mapping[str, str] = os.environ) -> Placement:
    """This vLLM worker's kvtier worker placement. ``allowed``: the parent's cores (the engine
    core is not bound; this process's main thread may be, by OpenMP)."""
    try:
        allowed = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        allowed = frozenset(os.sched_getaffinity(0))
    others = bound_elsewhere(environ)
    return choose(allowed, omp_cores(environ), others, numa_nodes(), explicit=bool(others))


def _cpu_list(text: str) -> frozenset[int]:
    return parse_cpu_list(text, "VLLM_CPU_OMP_THREADS_BIND")
