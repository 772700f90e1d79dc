"""The storage config parsed once into typed values, through one registry of backend kinds."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.memory.host import HostPool
from kvtier.storage import (
    BackendConfig,
    ChainConfig,
    describe_backend,
    make_backend,
    mooncake_config,
    parse_storage,
    register_backend,
)
from kvtier.storage import config as storage_config
from kvtier.storage.chain.store import TieredStore
from kvtier.storage.config import FaultConfig, MemoryConfig
from kvtier.storage.file.config import FileStoreConfig
from kvtier.storage.memory.store import MemoryStore
from kvtier.storage.mooncake.config import MooncakeConfig
from kvtier.testing.contract import CONTRACT_SPEC, expected_block, make_keys
from kvtier.worker.config import WorkerConfig

BUILT_IN = ("file", "mooncake", "memory")


@pytest.fixture
def kinds(monkeypatch):
    """The built-in kinds alone (another test of this process may have registered one: the
    docs' example does), restored after the test."""
    built_in = {k: v for k, v in storage_config._KINDS.items() if k in BUILT_IN}
    monkeypatch.setattr(storage_config, "_KINDS", built_in)
    # ... and by module path: a config elsewhere may have named an out-of-tree one
    monkeypatch.setattr(storage_config, "_MODULES", dict(storage_config.BUILT_IN))
    return storage_config._KINDS


def test_a_chain_parses_into_typed_tiers(tmp_path) -> None:
    parsed = parse_storage(
        {
            "tiers": [
                {"backend": "memory", "capacity_bytes": 1 << 20},
                {"backend": "file", "root": str(tmp_path), "faults": {"error_rate": 0.5}},
                {"backend": "mooncake", "master_address": "127.0.0.1:5"},
            ],
            "write": "back",
            "pending_bytes": 4096.0,
        }
    )
    assert isinstance(parsed, ChainConfig) and parsed.write == "back"
    assert parsed.pending_bytes == 4096 and isinstance(parsed.pending_bytes, int)
    memory, file, mooncake = parsed.tiers
    assert memory.options == MemoryConfig(1 << 20) and memory.faults is None
    assert isinstance(file.options, FileStoreConfig) and file.options.root == Path(tmp_path)
    assert file.faults == FaultConfig(error_rate=0.5)
    assert mooncake_config(parsed) == MooncakeConfig(master_address="127.0.0.1:5")
    assert describe_backend(parsed) == "memory+file+mooncake"
    assert parse_storage(parsed) is parsed  # typed already: as is
    assert parse_storage(None) == BackendConfig("file", FileStoreConfig.from_dict({}))
    assert mooncake_config(parse_storage({"backend": "memory"})) is None


def test_a_worker_parses_its_storage_once_and_opens_what_it_parsed(tmp_path, kinds) -> None:
    parses = []
    file_kind = kinds["file"]

    def counted(options):
        parses.append(options)
        return file_kind.parse(options)

    kinds["file"] = dataclasses.replace(file_kind, parse=counted)
    config = WorkerConfig(
        spec=CONTRACT_SPEC,
        instance_id=f"cfg{uuid.uuid4().hex[:6]}",
        device_cache_mode="create",
        storage={"backend": "file", "root": str(tmp_path / "store")},
    )
    assert len(parses) == 1  # checked when the settings were made
    assert config.storage_config is config.storage_config
    with make_backend(config.spec, config.storage_config) as store:
        assert store.config is config.storage_config.options  # opened from the parsed value
    assert len(parses) == 1


def test_a_registered_backend_is_valid_wherever_a_storage_is(tmp_path, kinds) -> None:
    @dataclasses.dataclass(frozen=True)
    class Options:
        label: str

        @classmethod
        def from_dict(cls, data):
            if not isinstance(data.get("label"), str):
                raise ConfigError("storage.label", "must be text")
            return cls(data["label"])

    opened = []

    def build(spec, options, mac_key):
        opened.append((options, mac_key))
        return MemoryStore(spec, mac_key=mac_key)

    register_backend("mine", Options.from_dict, build)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("mine", Options.from_dict, build)
    with pytest.raises(ConfigError) as error:
        parse_storage({"tiers": [{"backend": "memory"}, {"backend": "mine", "label": 5}]})
    assert error.value.field == "storage.tiers[1].label"
    with pytest.raises(ConfigError, match="allowed: file, mooncake, memory, s3, mine"):
        parse_storage({"backend": "yours"})

    chain = {"tiers": [{"backend": "memory"}, {"backend": "mine", "label": "x"}]}
    with HostPool(CONTRACT_SPEC, 4) as pool, make_backend(CONTRACT_SPEC, chain) as store:
        assert isinstance(store, TieredStore) and opened == [(Options("x"), None)]
        keys = make_keys(2)
        blocks = [pool.block(i) for i in range(2)]
        for key, block in zip(keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        assert store.put_from(keys, blocks) == [True, True]
        assert store.writer.flush(30) == 0
        below = store.tiers[1]
        out = [pool.block(2 + i) for i in range(2)]
        assert below.get_into(keys, out) == [True, True]  # the bytes reached the new kind
        for key, block in zip(keys, out):
            assert block.equal(expected_block(key, block.numel()))


@pytest.mark.parametrize(
    "storage, field",
    [
        ({"backend": "file", "capacity_bytes": True}, "storage.capacity_bytes"),
        ({"backend": "file", "io_threads": True}, "storage.io_threads"),
        ({"backend": "memory", "capacity_bytes": 1.5}, "storage.capacity_bytes"),
        ({"backend": "memory", "faults": "slow"}, "storage.faults"),
        ({"backend": "memory", "faults": {"latency_s": "1"}}, "storage.faults.latency_s"),
        ({"backend": "memory", "mac_key_file": 5}, "storage.mac_key_file"),
        (
            {"tiers": [{"backend": "memory"}, {"backend": "file", "faults": {"error_rate": 2}}]},
            "storage.tiers[1].faults.error_rate",
        ),
        ({"tiers": [{"backend": "memory"}], "flush_timeout_s": "10"}, "storage.flush_timeout_s"),
        ({"tiers": [{"backend": "memory"}], "mac_key_file": 5}, "storage.mac_key_file"),
        ("file", "storage"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(storage, field) -> None:
    with pytest.raises(ConfigError) as error:
        parse_storage(storage)
    assert error.value.field == field


def test_a_vllm_start_parses_its_storage_once_per_process(tmp_path, kinds, monkeypatch) -> None:
    """The settings check, the scheduler's and the worker's connector and the launcher's rank
    configs all read the storage of one engine process: one parse, one typed value, the same
    on every side (the environment merged in included). Another environment is another parse."""
    # local: the engine side's settings and launcher (kept out of this module's imports)
    from kvtier.engine.launcher import worker_configs
    from kvtier.vllm.settings import ConnectorSettings

    parses = []
    file_kind = storage_config._kind("file")  # loaded (a kind is imported on first use)
    kinds["file"] = dataclasses.replace(
        file_kind, parse=lambda options: parses.append(options) or file_kind.parse(options)
    )
    monkeypatch.delenv("KVTIER_STORAGE", raising=False)
    storage = {"backend": "file", "capacity_bytes": 1 << 30}  # the default root: from XDG
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    scheduler = ConnectorSettings.from_extra_config({"storage": storage})
    worker = ConnectorSettings.from_extra_config({"storage": storage})
    ranks = worker_configs(CONTRACT_SPEC, 2, storage, f"cfg{uuid.uuid4().hex[:6]}", None, {})
    typed = {id(c.storage_config) for c in (scheduler, worker, *ranks)}
    assert len(parses) == 1 and len(typed) == 1
    assert scheduler.storage_config.options.root == tmp_path / "a" / "kvtier" / "store"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    moved = ConnectorSettings.from_extra_config({"storage": storage}).storage_config
    assert len(parses) == 2 and moved.options.root == tmp_path / "b" / "kvtier" / "store"
