"""KVCacheSpec: sizes, fingerprints, validation, and the ways to build one."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.layout.legacy_flags import spec_from_flags
from kvtier.layout.spec import CacheDType, KVCacheSpec, Part


def test_sizes_bf16() -> None:
    s = KVCacheSpec(num_layers=32, num_blocks=100, num_kv_heads=8, block_size=64, head_dim=128)
    assert s.parts == (Part.KEY, Part.VALUE)
    assert s.part_block_bytes(Part.KEY) == 8 * 64 * 128 * 2
    assert s.block_bytes == 32 * 2 * 8 * 64 * 128 * 2 == 8 << 20
    assert s.device_bytes == 100 * s.block_bytes
    assert s.part_shape(Part.VALUE) == (100, 8, 64, 128)


def test_fp8_has_scales_in_page_first_order() -> None:
    s = KVCacheSpec(
        num_layers=2,
        num_blocks=4,
        num_kv_heads=2,
        block_size=16,
        head_dim=64,
        dtype="block_wise_fp8",
    )
    assert s.parts == (Part.KEY, Part.VALUE, Part.KEY_SCALE, Part.VALUE_SCALE)
    assert s.part_block_bytes(Part.KEY) == 2 * 16 * 64
    assert s.part_block_bytes(Part.KEY_SCALE) == 2 * 16 * 2  # bf16 scale per (head, token)
    assert s.part_shape(Part.KEY_SCALE, 7) == (7, 2, 16)
    offsets = [(p.layer, p.part, p.offset_bytes) for p in s.pieces]
    assert offsets[:5] == [
        (0, Part.KEY, 0),
        (0, Part.VALUE, 2048),
        (0, Part.KEY_SCALE, 4096),
        (0, Part.VALUE_SCALE, 4160),
        (1, Part.KEY, 4224),
    ]
    assert s.block_bytes == 2 * (2048 * 2 + 64 * 2)


def test_mla_is_key_only() -> None:
    s = KVCacheSpec(
        num_layers=4, num_blocks=4, num_kv_heads=1, block_size=16, head_dim=576, has_value=False
    )
    assert s.parts == (Part.KEY,)
    assert s.block_bytes == 4 * 16 * 576 * 2


def test_extra_layers_have_own_block_count() -> None:
    s = KVCacheSpec(
        num_layers=2,
        num_blocks=10,
        num_kv_heads=1,
        block_size=4,
        head_dim=8,
        num_extra_layers=1,
        num_extra_blocks=25,
    )
    assert s.total_layers == 3
    assert [s.layer_num_blocks(i) for i in range(3)] == [10, 10, 25]
    assert s.usable_num_blocks == 10
    assert s.block_bytes == 3 * s.layer_block_bytes
    default = KVCacheSpec(
        num_layers=2, num_blocks=10, num_kv_heads=1, block_size=4, head_dim=8, num_extra_layers=1
    )
    assert default.num_extra_blocks == 10


def test_fingerprint_is_stable_and_ignores_block_counts() -> None:
    a = KVCacheSpec(num_layers=8, num_blocks=100, num_kv_heads=8, block_size=16, head_dim=128)
    b = KVCacheSpec(num_layers=8, num_blocks=999, num_kv_heads=8, block_size=16, head_dim=128)
    # A literal: the same on every machine and Python version (sha256 of canonical JSON).
    assert a.fingerprint == "c22cf1da9e80e87b"
    assert a.fingerprint == b.fingerprint
    for change in (
        {"num_kv_heads": 4},
        {"block_size": 64},
        {"dtype": "float16"},
        {"has_value": False},
        {"num_extra_layers": 1},
        {"num_layers": 9},
        {"head_dim": 64},
    ):
        other = KVCacheSpec(**{**a.to_dict(), **change})
        assert other.fingerprint != a.fingerprint, change


def test_scale_dtype_only_matters_for_fp8() -> None:
    base = dict(num_layers=1, num_blocks=1, num_kv_heads=1, block_size=1, head_dim=1)
    assert KVCacheSpec(**base, scale_dtype="float32").fingerprint == KVCacheSpec(**base).fingerprint
    fp8 = dict(base, dtype="block_wise_fp8")
    assert KVCacheSpec(**fp8, scale_dtype="float32").fingerprint != KVCacheSpec(**fp8).fingerprint


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"num_kv_heads": 2.5}, "num_kv_heads"),
        ({"block_size": True}, "block_size"),
        ({"dtype": "int4"}, "dtype"),
        ({"scale_dtype": "uint8"}, "scale_dtype"),
        ({"num_extra_layers": -1}, "num_extra_layers"),
        ({"num_extra_blocks": 0, "num_extra_layers": 1}, "num_extra_blocks"),
        ({"has_value": "yes"}, "has_value"),
    ],
)
def test_validation_names_the_field(change: dict, field: str) -> None:
    base = dict(num_layers=1, num_blocks=1, num_kv_heads=1, block_size=1, head_dim=1)
    with pytest.raises(ConfigError) as e:
        KVCacheSpec(**{**base, **change})
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}:")


def test_dtype_error_lists_allowed_values() -> None:
    with pytest.raises(ConfigError, match="float16, bfloat16, float32, uint8, block_wise_fp8"):
        KVCacheSpec(
            num_layers=1, num_blocks=1, num_kv_heads=1, block_size=1, head_dim=1, dtype="fp4"
        )


def test_from_dict_and_yaml(tmp_path) -> None:
    d = {
        "num_layers": 2,
        "num_blocks": 8,
        "num_kv_heads": 2,
        "block_size": 16,
        "head_dim": 64,
        "dtype": "float16",
    }
    s = KVCacheSpec.from_dict(d)
    assert s.dtype is CacheDType.FLOAT16
    assert KVCacheSpec.from_dict(s.to_dict()) == s
    (tmp_path / "spec.yaml").write_text(
        "spec:\n  num_layers: 2\n  num_blocks: 8\n  num_kv_heads: 2\n"
        "  block_size: 16\n  head_dim: 64\n  dtype: float16\n"
    )
    assert KVCacheSpec.from_yaml(tmp_path / "spec.yaml") == s
    with pytest.raises(ConfigError, match="num_heads: unknown spec field"):
        KVCacheSpec.from_dict({**d, "num_heads": 3})
    with pytest.raises(ConfigError, match="head_dim: is required"):
        KVCacheSpec.from_dict({k: v for k, v in d.items() if k != "head_dim"})
    with pytest.raises(ConfigError, match="spec: must be a mapping"):
        KVCacheSpec.from_dict([1, 2])  # type: ignore[arg-type]


def test_from_old_engine_flags() -> None:
    s = spec_from_flags(
        [
            "--key_cache_shape",
            "100,8,64,128",
            "--value_cache_shape",
            "100,8,64,128",
            "--cache_dtype",
            "block_wise_fp8",
            "--num_layers",
            "4",
            "--num_extra_layers",
            "1",
            "--extra_layer_block_ratio",
            "1.5",
            "--rank",
            "3",  # unrelated flags are ignored
        ]
    )
    assert (s.num_blocks, s.num_kv_heads, s.block_size, s.head_dim) == (100, 8, 64, 128)
    assert s.has_value and s.has_scales and s.num_layers == 4
    assert s.num_extra_layers == 1 and s.num_extra_blocks == 150


def test_from_flags_mla_and_errors() -> None:
    mla = spec_from_flags(["--key_cache_shape", "10,1,64,576", "--num_layers", "2"])
    assert not mla.has_value
    with pytest.raises(ConfigError, match="key_cache_shape: expected N,H,B,D"):
        spec_from_flags(["--key_cache_shape", "10,1,64", "--num_layers", "2"])
    with pytest.raises(ConfigError, match="value_cache_shape"):
        spec_from_flags(
            [
                "--key_cache_shape",
                "10,1,64,8",
                "--value_cache_shape",
                "10,2,64,8",
                "--num_layers",
                "2",
            ]
        )
    with pytest.raises(ConfigError, match="dtype"):
        spec_from_flags(
            ["--key_cache_shape", "10,1,64,8", "--cache_dtype", "int8", "--num_layers", "2"]
        )
