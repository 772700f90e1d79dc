"""A worker process's cores (``kvtier.common.cpus``): moved where its settings say, and never
more torch threads than it has cores (kvtier's parallel copies start as many)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a child: this test process's own torch threads stay as they are.
CHILD = """
import os, sys
from kvtier.common.cpus import run_on
import torch
torch.set_num_threads(8)  # as an inherited OMP_NUM_THREADS of 8 compute cores would
before = torch.get_num_threads()
where = sys.argv[1]
if where == "none":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
run_on(None if where == "none" else where)
print(before, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("where", ["none", "first"])
def test_an_inherited_omp_num_threads_is_cut_to_the_workers_cores(where: str) -> None:
    """A worker started from a vLLM worker starts with that rank's compute cores and its
    OMP_NUM_THREADS; placed on one core (moved there, or started there), it keeps one thread."""
    first = min(os.sched_getaffinity(0))
    arg = "none" if where == "none" else str(first)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, arg], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, cores = out.stdout.split(maxsplit=2)
    assert (int(before), int(after), cores.strip()) == (8, 1, f"[{first}]")
