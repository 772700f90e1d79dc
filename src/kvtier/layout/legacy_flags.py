"""The old engine's cache flags (``--key_cache_shape N,H,B,D`` and friends) -> KVCacheSpec."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec


def spec_from_flags(argv: Sequence[str]) -> KVCacheSpec:
    """Build a spec from the old engine's flags; other flags in ``argv`` are ignored."""
    args, _ = legacy_flag_parser().parse_known_args(list(argv))
    return spec_from_legacy_args(args)


def spec_from_legacy_args(args: argparse.Namespace) -> KVCacheSpec:
    """From a namespace parsed with ``legacy_flag_parser`` (also part of ``kvtier serve``)."""
    from kvtier.layout.spec import KVCacheSpec

    key_shape = _parse_shape("key_cache_shape", args.key_cache_shape)
    value_raw = args.value_cache_shape
    has_value = bool(value_raw and value_raw.strip())
    if has_value:
        value_shape = _parse_shape("value_cache_shape", value_raw)
        if value_shape != key_shape:
            raise ConfigError(
                "value_cache_shape",
                f"{value_raw} differs from key_cache_shape {args.key_cache_shape}; "
                "kvtier needs K and V of one shape (leave it empty for MLA)",
            )
    num_blocks, heads, block_size, head_dim = key_shape
    extra_blocks = args.num_extra_layer_gpu_blocks
    if args.num_extra_layers and extra_blocks is None and args.extra_layer_block_ratio:
        if args.extra_layer_block_ratio <= 0:
            raise ConfigError("extra_layer_block_ratio", "must be > 0")
        extra_blocks = int(num_blocks * args.extra_layer_block_ratio)
    return KVCacheSpec(
        num_layers=args.num_layers,
        num_blocks=num_blocks,
        num_kv_heads=heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=args.cache_dtype,
        scale_dtype=args.scale_dtype,
        has_value=has_value,
        num_extra_layers=args.num_extra_layers,
        num_extra_blocks=extra_blocks if args.num_extra_layers else None,
    )


def legacy_flag_parser(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup | None = None, required: bool = True
):
    """Add the old engine's cache flags to ``parser`` (or a new one) and return it."""
    p = parser or argparse.ArgumentParser(add_help=False)
    p.add_argument("--key_cache_shape", required=required, help="N,H,B,D of each key cache")
    p.add_argument("--value_cache_shape", default="", help="N,H,B,D; empty for MLA (K only)")
    p.add_argument(
        "--cache_dtype",
        default="bfloat16",
        help="bfloat16|float16|float32|uint8|block_wise_fp8",
    )
    p.add_argument("--scale_dtype", default="bfloat16", help="dtype of fp8 scales")
    p.add_argument("--num_layers", type=int, required=required, help="attention layers")
    p.add_argument("--num_extra_layers", type=int, default=0, help="MTP / draft layers")
    p.add_argument(
        "--num_extra_layer_gpu_blocks",
        type=int,
        default=None,
        help="device blocks of the extra layers (default: num_blocks x --extra_layer_block_ratio)",
    )
    p.add_argument(
        "--extra_layer_block_ratio",
        type=float,
        default=None,
        help="extra-layer blocks = num_blocks x ratio (when no explicit count)",
    )
    return p


def _parse_shape(field: str, text: str) -> tuple[int, int, int, int]:
    try:
        dims = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(field, f"expected N,H,B,D (four integers), got {text!r}") from None
    if len(dims) != 4 or any(d <= 0 for d in dims):
        raise ConfigError(field, f"expected N,H,B,D (four positive integers), got {text!r}")
    return dims[0], dims[1], dims[2], dims[3]
