"""Worker configuration: YAML, KVTIER_* variables and flags, errors that name the field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.worker.config import WorkerConfig, load_config
from worker_helpers import WSPEC


def _yaml(tmp_path, **extra):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"spec": WSPEC.to_dict(), "instance_id": "abc", **extra}))
    return path


def test_precedence_flags_over_env_over_yaml(tmp_path) -> None:
    path = _yaml(tmp_path, rank=0, world_size=4, num_host_blocks=8)
    env = {"KVTIER_RANK": "2", "KVTIER_NUM_HOST_BLOCKS": "32", "KVTIER_STORAGE_BACKEND": "memory"}
    cfg = load_config(path, {"num_host_blocks": 64, "namespace": None}, env)
    assert (cfg.rank, cfg.world_size, cfg.num_host_blocks) == (2, 4, 64)
    assert cfg.storage == {"backend": "memory"}
    assert cfg.device_cache_name == "kvtier-abc-rank2-dev0"
    assert cfg.endpoint_address.startswith("ipc://") and cfg.endpoint_address.endswith(
        "abc-rank2.sock"
    )
    assert WorkerConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"rank": 3, "world_size": 2}, "rank"),
        ({"device_cache_mode": "borrow"}, "device_cache_mode"),
        ({"num_host_blocks": 0}, "num_host_blocks"),
        ({"engine_timeout_s": 0}, "engine_timeout_s"),
        ({"endpoint": "tcp://10.0.0.1:5000"}, "endpoint"),
        ({"instance_id": "a b"}, "instance_id"),
        ({"colour": "red"}, "colour"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_errors_name_the_field(tmp_path, settings, field) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, **settings), {}, {})
    assert e.value.field == field


def test_env_value_of_the_wrong_type(tmp_path) -> None:
    with pytest.raises(ConfigError, match="KVTIER_RANK='two' is not a int"):
        load_config(_yaml(tmp_path), {}, {"KVTIER_RANK": "two"})


def test_serve_refuses_bad_flags_with_one_line(tmp_path) -> None:
    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvtier.ops.cli", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = serve("--config", str(_yaml(tmp_path)), "--write_policy", "write_around")
    assert out.returncode == 2
    assert "write_policy: got 'write_around'; allowed: write_through, write_back" in out.stderr
    out = serve(
        "--instance-id",
        "x",
        "--key_cache_shape",
        "10,2,16,64",
        "--num_layers",
        "2",
        "--storage_backend",
        "redis",
        "--device-cache-mode",
        "create",
    )
    assert out.returncode == 2
    assert "storage.backend: got 'redis'; allowed: file, mooncake, memory" in out.stderr


# ---- one configuration path: sources merged field by field ---------------------------------

FIELDS = {  # field -> (value, how each source spells it)
    "num_host_blocks": 8,
    "namespace": "llama.sha256",
    "storage.backend": "file",
    "storage.root": None,  # tmp_path, filled in below
    "storage.capacity_bytes": 1 << 30,
}
FLAGS = {
    "num_host_blocks": "--num-host-blocks",
    "namespace": "--namespace",
    "storage.backend": "--storage-backend",
    "storage.root": "--storage-root",
}
ENV = {
    "num_host_blocks": "KVTIER_NUM_HOST_BLOCKS",
    "namespace": "KVTIER_NAMESPACE",
    "storage.backend": "KVTIER_STORAGE_BACKEND",
}


def _resolve_split(tmp_path, placement: dict[str, str], values: dict) -> WorkerConfig:
    """``kvtier serve`` with each field given where ``placement`` says (yaml, env or flag)."""
    from kvtier.ops.cli import _serve_overrides, build_parser

    yaml_data: dict = {"spec": WSPEC.to_dict(), "instance_id": "abc"}
    env: dict[str, str] = {}
    argv = ["serve"]
    env_storage: dict = {}
    for name, where in placement.items():
        value = values[name]
        top, _, sub = name.partition(".")
        if where == "yaml":
            (yaml_data.setdefault(top, {}) if sub else yaml_data)[sub or top] = value
        elif where == "env" and name in ENV:
            env[ENV[name]] = str(value)
        elif where == "env":  # a storage option without a variable of its own
            env_storage[sub] = value
        else:
            argv += [FLAGS[name], str(value)]
    if env_storage:
        env["KVTIER_STORAGE"] = yaml.safe_dump(env_storage, default_flow_style=True)
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(yaml_data))
    args = build_parser().parse_args([*argv, "--config", str(path)])
    return load_config(args.config, _serve_overrides(args), env)


def test_every_source_and_combination_resolves_identically(tmp_path) -> None:
    """Each of five fields from the YAML, the environment or a flag (every combination: 162):
    the same config. Before, a --storage-backend flag replaced the YAML's whole storage."""
    import itertools

    values = {**FIELDS, "storage.root": str(tmp_path / "store")}
    names = list(values)
    choices = [("yaml", "env", "flag") if n in FLAGS else ("yaml", "env") for n in names]
    configs = {
        where: _resolve_split(tmp_path, dict(zip(names, where)), values)
        for where in itertools.product(*choices)
    }
    assert len(configs) == 162
    first = next(iter(configs.values()))
    assert first.num_host_blocks == 8 and first.namespace == "llama.sha256"
    assert first.storage == {
        "backend": "file",
        "root": str(tmp_path / "store"),
        "capacity_bytes": 1 << 30,
    }
    assert all(c == first for c in configs.values())


def test_the_flag_that_dropped_the_yaml_store_keeps_it(tmp_path) -> None:
    """`kvtier serve --config w.yaml --storage-backend file`: the YAML's root and capacity."""
    from kvtier.ops.cli import _serve_overrides, build_parser

    store = {"backend": "file", "root": str(tmp_path / "s"), "capacity_bytes": 4096}
    path = _yaml(tmp_path, storage=store)
    args = build_parser().parse_args(["serve", "--config", str(path), "--storage-backend", "file"])
    assert load_config(args.config, _serve_overrides(args), {}).storage == store


def test_later_sources_win_field_by_field(tmp_path) -> None:
    path = _yaml(tmp_path, num_host_blocks=2, namespace="y", storage={"backend": "memory"})
    env = {"KVTIER_NUM_HOST_BLOCKS": "4", "KVTIER_NAMESPACE": "e"}
    cfg = load_config(path, {"num_host_blocks": 6}, env)
    assert (cfg.num_host_blocks, cfg.namespace, cfg.storage) == (6, "e", {"backend": "memory"})
    mooncake = {"KVTIER_MOONCAKE_PROTOCOL": "rdma", "KVTIER_MOONCAKE_DEVICE_NAME": "mlx5_0"}
    cfg = load_config(path, {}, mooncake)  # Mooncake variables: only for the mooncake backend
    assert cfg.storage == {"backend": "memory"}
    path = _yaml(tmp_path, storage={"backend": "mooncake", "protocol": "tcp", "device_name": ""})
    cfg = load_config(path, {"storage": {"device_name": "mlx5_1"}}, mooncake)
    assert (cfg.storage["protocol"], cfg.storage["device_name"]) == ("rdma", "mlx5_1")


@pytest.mark.parametrize(
    ("yaml_settings", "env", "flags", "message"),
    [
        ({}, {"KVTIER_NUM_HOST_BLOCKS": "0"}, [], "got 0 (set by KVTIER_NUM_HOST_BLOCKS)"),
        ({"num_host_blocks": 0}, {}, [], "got 0 (set by {yaml})"),
        ({}, {}, ["--rank", "5"], "rank: 5 must be < world_size 1 (set by --rank)"),
        (
            {"storage": {"backend": "file", "root": "/x"}},
            {"KVTIER_STORAGE_BACKEND": "memory"},
            [],
            "storage.root: unknown option for the memory backend; allowed: "
            "capacity_bytes (set by {yaml})",
        ),
        (
            {},
            {},
            ["--storage-backend", "memory", "--storage-root", "/x"],
            "storage.root: unknown option for the memory backend; allowed: "
            "capacity_bytes (set by --storage-root)",
        ),
        ({}, {"KVTIER_STORAGE": "{io_threads: 0}"}, [], "1..64, got 0 (set by KVTIER_STORAGE)"),
    ],
)
def test_errors_name_the_source_of_the_value(tmp_path, yaml_settings, env, flags, message):
    from kvtier.ops.cli import _serve_overrides, build_parser

    path = _yaml(tmp_path, **yaml_settings)
    args = build_parser().parse_args(["serve", "--config", str(path), *flags])
    with pytest.raises(ConfigError) as e:
        load_config(args.config, _serve_overrides(args), env)
    assert str(e.value).endswith(message.format(yaml=path)), str(e.value)


def test_launch_and_the_connector_resolve_as_serve_does(tmp_path, monkeypatch) -> None:
    """Client.launch and the vLLM connector: the environment under their arguments, as under
    serve's flags; a launched worker does not read the environment a second time."""
    from kvtier.engine.launcher import worker_configs

    monkeypatch.setenv("KVTIER_NAMESPACE", "from-env")
    monkeypatch.setenv("KVTIER_STORAGE", f"{{root: {tmp_path}, capacity_bytes: 4096}}")
    monkeypatch.setenv("KVTIER_RANK", "1")  # the launch's own per-rank value wins
    (cfg,) = worker_configs(WSPEC, 2, {"backend": "file"}, "abc", [0], {"num_host_blocks": 3})
    assert (cfg.rank, cfg.namespace, cfg.num_host_blocks) == (0, "from-env", 3)
    assert cfg.storage == {"backend": "file", "root": str(tmp_path), "capacity_bytes": 4096}
    with pytest.raises(ConfigError, match=r"got 0 \(set by kv_connector_extra_config\)"):
        worker_configs(
            WSPEC, 1, None, "abc", None, {"staging_blocks": 0}, "kv_connector_extra_config"
        )
    # What the launcher writes is complete: serve --config-is-complete ignores the environment.
    from kvtier.ops.cli import _serve_overrides, build_parser

    path = tmp_path / "rank0.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    args = build_parser().parse_args(["serve", "--config-is-complete", "--config", str(path)])
    assert args.config_is_complete
    assert load_config(args.config, _serve_overrides(args), {}) == cfg


def test_a_socket_path_too_long_for_unix_is_a_config_error(tmp_path, monkeypatch) -> None:
    """ZeroMQ's "File name too long" named neither the path nor what to change."""
    from kvtier.worker.config import MAX_SOCKET_PATH, endpoint_for

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    fits = "i" * (MAX_SOCKET_PATH - len(f"{tmp_path}/kvtier-{os.getuid()}/-rank0.sock"))
    assert endpoint_for(fits, 0).startswith("ipc://")
    with pytest.raises(ConfigError, match="endpoint: the socket path .* XDG_RUNTIME_DIR"):
        endpoint_for(fits + "x", 0)
