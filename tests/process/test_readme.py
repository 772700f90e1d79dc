"""The README's Python examples run as written, so they cannot rot."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        if "not run by tests/process/test_readme.py" in code:
            continue
        # A unique instance id, so a parallel run or a live engine never collides with the example.
        unique = uuid.uuid4().hex[:8]
        code = code.replace("kvtier-myengine-", f"kvtier-readme{unique}-")
        code = code.replace('"readme-tp"', f'"readme{unique}"')
        exec(compile(code, str(README), "exec"), {})


def test_ci_runs_the_readmes_test_command() -> None:
    """Command 2 of the README is what .ci/run runs (quiet flags aside): both stay true."""
    text = README.read_text()
    command = next(
        line
        for line in text.splitlines()
        if line.startswith("pip install torch") and "pytest" in line
    )
    ci = (README.parent / ".ci" / "run").read_text()
    ran = next(
        line for line in ci.splitlines() if line.startswith("pip install") and "pytest" in line
    )
    assert ran.replace(" -q", "") == command
