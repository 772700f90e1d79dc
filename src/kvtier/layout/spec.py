"""KVCacheSpec: the shape of an engine's KV cache, its byte sizes and its layout fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from kvtier.common.config_sources import refuse_unknown
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import torch


class CacheDType(str, Enum):
    """Element type of the KV cache. BLOCK_WISE_FP8 is uint8 data plus per-token scales."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    UINT8 = "uint8"
    BLOCK_WISE_FP8 = "block_wise_fp8"


class Part(str, Enum):
    """One tensor of a layer: keys, values, and (fp8 only) their scales; or K|V fused."""

    KEY = "key"
    VALUE = "value"
    KEY_SCALE = "key_scale"
    VALUE_SCALE = "value_scale"
    KEY_VALUE = "key_value"  # one tensor per layer holding K and V: [N, H, B, 2 * head_dim]


class KVLayout(str, Enum):
    """How a layer's K and V are laid out in device memory.

    ``separate``: one K and one V tensor per layer, each [num_blocks, heads, block_size, head_dim].
    ``fused``: one tensor per layer, [num_blocks, heads, block_size, 2 * head_dim], whose inner
    byte order is the engine's (vLLM 0.32's CPU and GPU backends differ): ``engine_layout`` names
    it, and both are part of the fingerprint, so objects of one byte order are never read as
    another.
    """

    SEPARATE = "separate"
    FUSED = "fused"


SCALE_DTYPES = ("bfloat16", "float16", "float32")

# (torch name, bytes per element). torch is imported only where tensors are made: the operator
# tools (kvtier store, kvtier status) use specs and keys without it.
_DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "float32": ("float32", 4),
    "uint8": ("uint8", 1),
    "block_wise_fp8": ("uint8", 1),
}

# Fields that decide the bytes of one page-first block. Block counts are left out on purpose:
# two engines with different cache sizes but the same layout can share stored blocks.
_LAYOUT_FIELDS = (
    "num_layers",
    "num_extra_layers",
    "num_kv_heads",
    "block_size",
    "head_dim",
    "dtype",
    "scale_dtype",
    "has_value",
)
# Left out of the fingerprint at their defaults, so that objects stored before they existed
# keep their fingerprint.
_OPTIONAL_LAYOUT_FIELDS = {"kv_layout": "separate", "engine_layout": ""}
FINGERPRINT_VERSION = 1


class Piece(NamedTuple):
    """Where one (layer, part) of a block sits inside a page-first host block."""

    layer: int
    part: Part
    offset_bytes: int
    size_bytes: int


def _check_positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer: K (and V unless MLA) of shape [num_blocks, num_kv_heads, block_size, head_dim].

    Block-wise fp8 caches (dtype ``block_wise_fp8``) hold uint8 data plus one scale per
    (block, head, token) for each part, of shape [num_blocks, num_kv_heads, block_size] in
    ``scale_dtype``. Extra layers (speculative decoding / MTP draft layers) follow the main
    layers and may have their own block count ``num_extra_blocks`` (default: ``num_blocks``).
    """

    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: CacheDType = CacheDType.BFLOAT16
    scale_dtype: str = "bfloat16"
    has_value: bool = True
    num_extra_layers: int = 0
    num_extra_blocks: int | None = None
    kv_layout: KVLayout = KVLayout.SEPARATE
    engine_layout: str = ""  # names the engine's byte order inside a block, e.g. "vllm-cpu"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_dim"):
            _check_positive_int(field, getattr(self, field))
        try:
            dtype = CacheDType(self.dtype)
        except ValueError:
            allowed = ", ".join(d.value for d in CacheDType)
            raise ConfigError("dtype", f"got {self.dtype!r}; allowed: {allowed}") from None
        object.__setattr__(self, "dtype", dtype)
        if self.scale_dtype not in SCALE_DTYPES:
            allowed = ", ".join(SCALE_DTYPES)
            raise ConfigError("scale_dtype", f"got {self.scale_dtype!r}; allowed: {allowed}")
        if not isinstance(self.has_value, bool):
            raise ConfigError("has_value", f"must be true or false, got {self.has_value!r}")
        extra = self.num_extra_layers
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
            raise ConfigError("num_extra_layers", f"must be an integer >= 0, got {extra!r}")
        if self.num_extra_blocks is not None:
            _check_positive_int("num_extra_blocks", self.num_extra_blocks)
        if self.num_extra_blocks is None or extra == 0:
            object.__setattr__(self, "num_extra_blocks", self.num_blocks if extra else None)
        try:
            kv_layout = KVLayout(self.kv_layout)
        except ValueError:
            raise ConfigError(
                "kv_layout", f"got {self.kv_layout!r}; allowed: separate, fused"
            ) from None
        object.__setattr__(self, "kv_layout", kv_layout)
        if kv_layout is KVLayout.FUSED and (not self.has_value or self.has_scales):
            raise ConfigError(
                "kv_layout", "fused K|V needs has_value=true and a dtype without scales"
            )
        if not isinstance(self.engine_layout, str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{0,64}", self.engine_layout
        ):
            raise ConfigError(
                "engine_layout",
                f"must be up to 64 letters, digits, '._-', got {self.engine_layout!r}",
            )

    # ---- shapes and sizes -------------------------------------------------------------------

    @property
    def total_layers(self) -> int:
        """Main layers plus extra (draft) layers."""
        return self.num_layers + self.num_extra_layers

    @property
    def has_scales(self) -> bool:
        return self.dtype is CacheDType.BLOCK_WISE_FP8

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        """The tensors of one layer, in page-first order."""
        if self.kv_layout is KVLayout.FUSED:
            return (Part.KEY_VALUE,)
        parts = [Part.KEY]
        if self.has_value:
            parts.append(Part.VALUE)
        if self.has_scales:
            parts.append(Part.KEY_SCALE)
            if self.has_value:
                parts.append(Part.VALUE_SCALE)
        return tuple(parts)

    def torch_dtype(self, part: Part) -> torch.dtype:
        import torch

        return getattr(torch, _DTYPES[self._dtype_name(part)][0])

    def _dtype_name(self, part: Part) -> str:
        if part in (Part.KEY_SCALE, Part.VALUE_SCALE):
            return self.scale_dtype
        return self.dtype.value

    def layer_num_blocks(self, layer: int) -> int:
        """Blocks in the device tensors of ``layer`` (extra layers may differ)."""
        if not 0 <= layer < self.total_layers:
            raise ConfigError("layer", f"{layer} is outside 0..{self.total_layers - 1}")
        if layer < self.num_layers:
            return self.num_blocks
        assert self.num_extra_blocks is not None
        return self.num_extra_blocks

    @cached_property
    def usable_num_blocks(self) -> int:
        """Device block ids valid in every layer (a swap moves all layers of a block)."""
        return min(self.layer_num_blocks(layer) for layer in range(self.total_layers))

    def part_shape(self, part: Part, num_blocks: int | None = None) -> tuple[int, ...]:
        """Shape of one device tensor for ``part`` with ``num_blocks`` blocks."""
        n = self.num_blocks if num_blocks is None else num_blocks
        if part in (Part.KEY_SCALE, Part.VALUE_SCALE):
            return (n, self.num_kv_heads, self.block_size)
        if part is Part.KEY_VALUE:
            return (n, self.num_kv_heads, self.block_size, 2 * self.head_dim)
        return (n, self.num_kv_heads, self.block_size, self.head_dim)

    def part_block_bytes(self, part: Part) -> int:
        """Bytes of one block of one part of one layer."""
        elements = self.num_kv_heads * self.block_size
        if part in (Part.KEY, Part.VALUE):
            elements *= self.head_dim
        elif part is Part.KEY_VALUE:
            elements *= 2 * self.head_dim
        return elements * _DTYPES[self._dtype_name(part)][1]

    @cached_property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, all parts."""
        return sum(self.part_block_bytes(p) for p in self.parts)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one page-first block: every layer and part of one block."""
        return self.total_layers * self.layer_block_bytes

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """Every (layer, part) of a page-first block with its offset, in memory order."""
        out: list[Piece] = []
        offset = 0
        for layer in range(self.total_layers):
            for part in self.parts:
                size = self.part_block_bytes(part)
                out.append(Piece(layer, part, offset, size))
                offset += size
        return tuple(out)

    @property
    def device_bytes(self) -> int:
        """Bytes of the whole device cache (every tensor of every layer)."""
        return sum(
            self.layer_num_blocks(layer) * self.part_block_bytes(part)
            for layer in range(self.total_layers)
            for part in self.parts
        )

    def host_bytes(self, num_host_blocks: int) -> int:
        return num_host_blocks * self.block_bytes

    # ---- identity ---------------------------------------------------------------------------

    def layout_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in _LAYOUT_FIELDS}
        d["dtype"] = self.dtype.value
        if not self.has_scales:
            d["scale_dtype"] = None  # irrelevant without scales; must not split fingerprints
        for name, default in _OPTIONAL_LAYOUT_FIELDS.items():
            value = getattr(self, name)
            value = value.value if isinstance(value, Enum) else value
            if value != default:
                d[name] = value
        return d

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits naming the page-first block layout; stable across machines/versions.

        Covers every field that changes the bytes of a block (layers, extra layers, heads,
        block size, head dim, dtypes, K/V or K only, fused K|V and the engine's byte order), not
        the block counts.
        """
        canonical = json.dumps(
            {"v": FINGERPRINT_VERSION, **self.layout_dict()}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"] = self.dtype.value
        d["kv_layout"] = self.kv_layout.value
        return d

    def differences(self, other: KVCacheSpec) -> list[str]:
        """Human-readable list of fields that differ, e.g. ``num_kv_heads: 8 != 4``."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVCacheSpec:
        """Build from a mapping (YAML, JSON); unknown keys are an error naming them."""
        if not isinstance(data, Mapping):
            raise ConfigError("spec", f"must be a mapping, got {type(data).__name__}")
        refuse_unknown(data, (f.name for f in dataclasses.fields(cls)), what="spec field")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in data
        ]
        if missing:
            raise ConfigError(missing[0], "is required")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> KVCacheSpec:
        with open(path) as f:
            data = yaml.safe_load(f)
        if isinstance(data, Mapping) and "spec" in data:
            data = data["spec"]
        return cls.from_dict(data)
