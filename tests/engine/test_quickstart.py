"""docs/vllm.md's quick start, run exactly as written: a newcomer on a machine that cannot
download a model builds one with ``kvtier make-model``, serves it with kvtier, sends one prompt
twice with vLLM's prefix cache emptied between, and sees kvtier's hit counter above 0.

The lines name port 8000 and three paths in /tmp, as a newcomer's would: they run in a network
namespace of their own (port 8000 is theirs whatever else runs here), and the paths must not
exist before (the test says so rather than remove what it did not make); it removes them after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import require_namespaces, require_vllm

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
QUICKSTART = re.compile(r"<!-- quickstart -->\n```bash\n(.*?)```\n<!-- /quickstart -->", re.S)
LOADED = re.compile(r"^vllm:kvtier_loaded_tokens_total\{[^}]*\} ([0-9.]+)$", re.M)
MADE = [Path("/tmp/kvtier-model"), Path("/tmp/kvtier-store"), Path("/tmp/kvtier-serve.log")]
TIMEOUT_S = 900  # a model build and a server start (1-2 minutes) beside the rest of the suite


def quickstart_lines() -> str:
    found = QUICKSTART.findall(DOC.read_text())
    assert len(found) == 1, "docs/vllm.md has one quick start between its markers"
    return found[0]


def test_the_documented_quick_start_ends_with_a_kvtier_hit() -> None:
    require_vllm()
    require_namespaces()
    assert not [p for p in MADE if p.exists()], "the quick start's paths exist: remove them"
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "XDG_RUNTIME_DIR")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # kvtier
    try:
        out = subprocess.run(  # the lines are bash's $0, run once loopback is up
            ["unshare", "--net", "bash", "-c", 'ip link set lo up && exec bash -ec "$0"']
            + [quickstart_lines()],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
            cwd="/",
        )
        log = MADE[2].read_text(errors="replace") if MADE[2].exists() else ""
    finally:
        for path in MADE:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    loaded = LOADED.findall(out.stdout)
    assert loaded and float(loaded[-1]) > 0, out.stdout[-3000:]
    answers = [
        json.loads(line)["choices"][0]["text"]
        for line in out.stdout.splitlines()
        if line.startswith('{"id":"cmpl-')
    ]
    assert len(answers) == 2 and answers[0] == answers[1], out.stdout[-3000:]  # greedy, the same
    # kvtier's own lines reach vLLM's log (docs/vllm.md promises where the worker runs).
    assert "kvtier: rank 0's worker runs" in log, log[-3000:]
