"""KvtierConnector against the ``KVConnectorBase_V1`` of every vLLM release kvtier accepts: 0.32
as installed (the engine tests run on it), 0.33 and 0.34 read from the released wheels without
installing them (``vllm_releases``: range requests, cached under ~/.cache/kvtier).

Checked: every abstract method is implemented; every method kvtier overrides has the release's
kind (method, property, classmethod) and parameter names; every hook a release adds after 0.32
is decided by kvtier explicitly (none left to a default nobody chose).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from conftest import REQUIRED, require_vllm

require_vllm()

import vllm.distributed.kv_transfer.kv_connector.v1.base as installed_base  # noqa: E402

from kvtier.vllm import SUPPORTED_VLLM, KvtierConnector  # noqa: E402
from vllm_releases import released_source  # noqa: E402

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
RELEASES = {"0.32": None, "0.33": "0.33.0", "0.34": "0.34.0"}  # None: the installed one


@dataclass(frozen=True)
class Method:
    kind: str  # method, property, classmethod, staticmethod
    params: tuple[str, ...]  # after self/cls, keyword-only included
    abstract: bool


def base_api(source: str) -> dict[str, Method]:
    """The methods of ``KVConnectorBase_V1`` in ``source``."""
    tree = ast.parse(source)
    cls = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "KVConnectorBase_V1"
    )
    api = {}
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {
            d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list
        }
        kind = next(
            (k for k in ("property", "classmethod", "staticmethod") if k in names), "method"
        )
        a = node.args
        params = [p.arg for p in [*a.posonlyargs, *a.args]][0 if kind == "staticmethod" else 1 :]
        params += [p.arg for p in a.kwonlyargs]
        api[node.name] = Method(kind, tuple(params), "abstractmethod" in names)
    return api


def ours() -> dict[str, tuple[str, tuple[str, ...], bool]]:
    """(kind, parameter names, takes **kwargs) of each method KvtierConnector defines."""
    found = {}
    for name, raw in vars(KvtierConnector).items():
        if isinstance(raw, property):
            kind, func = "property", raw.fget
        elif isinstance(raw, classmethod):
            kind, func = "classmethod", raw.__func__
        elif isinstance(raw, staticmethod):
            kind, func = "staticmethod", raw.__func__
        elif inspect.isfunction(raw):
            kind, func = "method", raw
        else:
            continue
        sig = list(inspect.signature(func).parameters.values())[
            0 if kind == "staticmethod" else 1 :
        ]
        named = tuple(p.name for p in sig if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        found[name] = (kind, named, any(p.kind is p.VAR_KEYWORD for p in sig))
    return found


def release_file(wheel_version: str, member: str) -> str:
    try:
        return released_source(wheel_version, member)
    except OSError as e:  # no network and nothing cached
        if "vllm" in REQUIRED:
            pytest.fail(f"vLLM {wheel_version}'s {member} could not be read: {e}")
        pytest.skip(f"vLLM {wheel_version}'s wheel not reachable: {e}")


def api_of(release: str) -> dict[str, Method]:
    wheel_version = RELEASES[release]
    if wheel_version is None:
        return base_api(inspect.getsource(installed_base))
    return base_api(release_file(wheel_version, BASE))


def test_every_accepted_release_is_checked_here() -> None:
    assert tuple(RELEASES) == SUPPORTED_VLLM


@pytest.mark.parametrize("release", list(RELEASES))
def test_the_connector_fits_the_releases_base_class(release: str) -> None:
    api, mine = api_of(release), ours()
    abstract = {name for name, m in api.items() if m.abstract}
    assert abstract, "no abstract method found: the base class was not parsed"
    assert sorted(abstract - set(mine)) == []
    for name in set(api) & set(mine):
        kind, params, takes_kwargs = mine[name]
        assert kind == api[name].kind, f"{name}: a {kind} here, a {api[name].kind} in {release}"
        expected = api[name].params
        if takes_kwargs:  # the base's extra keyword arguments are taken by **kwargs
            expected = expected[: len(params)]
        assert params == expected, f"{name}{params}: {release} calls it {name}{api[name].params}"
    added = set(api) - set(api_of("0.32"))
    assert sorted(added - set(mine)) == [], f"hooks {release} adds that kvtier leaves to defaults"


def test_what_the_newer_hooks_answer() -> None:
    """0.33 sleep mode: refused on CUDA (legacy IPC cannot export its allocations), followed on
    CPU; 0.34: lookahead hashes unused. ``kv_cache_access`` needs 0.34's enum (not installed
    here): its source is read instead."""
    cuda, cpu = SimpleNamespace(kv_buffer_device="cuda"), SimpleNamespace(kv_buffer_device="cpu")
    assert KvtierConnector.supports_sleep_mode(cuda) is False
    assert KvtierConnector.supports_sleep_mode(cpu) is True
    assert KvtierConnector.supports_lookahead_block_hashes(cuda) is False
    source = inspect.getsource(KvtierConnector.kv_cache_access)
    assert "KVCacheAccess.LEGACY_IPC" in source and "KVCacheAccess.IN_PROCESS" in source
    enum_source = release_file("0.34.0", "vllm/config/kv_transfer.py")
    for flag in ("LEGACY_IPC", "IN_PROCESS"):
        assert f"    {flag} = " in enum_source
