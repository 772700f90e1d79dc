"""Worker configuration: YAML, KVTIER_* variables and flags, errors that name the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from kvtier.config import WorkerConfig, load_config
from kvtier.errors import ConfigError
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
            [sys.executable, "-m", "kvtier.cli", "serve", *flags],
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
