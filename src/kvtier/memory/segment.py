"""CPU segments: the header page of a published device cache and where its tensors sit.

A CPU device cache is one shared-memory file: a 4 KiB header page (magic, format version, a JSON
description: spec, owner pid, sizes and the tensor placement), then the data region. Placement
is a ``SegmentLayout``: kvtier's own (each tensor contiguous, page-aligned) or an engine's (vLLM
puts every layer ``layer_stride`` apart in one buffer); the copier only needs each tensor's base
and block stride, so any placement with contiguous blocks works.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.errors import DeviceCacheError, LayoutMismatch
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory import shm

HEADER_BYTES = 4096
ALIGN_BYTES = 4096
_MAGIC = b"KVTIERDC"
_HEADER_FORMAT = "<8sII"  # magic, format version, json length
_FORMAT_VERSION = 2


def align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class SegmentLayout:
    """Where each (layer, part) tensor of a CPU segment lives, after the header page.

    ``pieces[i]`` is (offset_bytes, block_stride_bytes) of ``spec.pieces[i]``'s tensor: block b
    of that tensor starts at ``offset + b * block_stride``. ``data_bytes`` is the data region.
    """

    pieces: tuple[tuple[int, int], ...]
    data_bytes: int

    @classmethod
    def packed(cls, spec: KVCacheSpec) -> SegmentLayout:
        """kvtier's own placement: each tensor contiguous and page-aligned."""
        pieces, offset = [], 0
        for layer in range(spec.total_layers):
            for part in spec.parts:
                block = spec.part_block_bytes(part)
                pieces.append((offset, block))
                offset = align(offset + spec.layer_num_blocks(layer) * block)
        return cls(tuple(pieces), max(offset, ALIGN_BYTES))

    def check(self, spec: KVCacheSpec) -> None:
        """Raise LayoutMismatch unless every tensor fits in the region, aligned."""
        if len(self.pieces) != len(spec.pieces):
            raise LayoutMismatch(
                f"layout has {len(self.pieces)} tensors; the spec has {len(spec.pieces)}"
            )
        for piece, (offset, stride) in zip(spec.pieces, self.pieces):
            where = f"layer {piece.layer} {piece.part.value}"
            itemsize = spec.torch_dtype(piece.part).itemsize
            n = spec.layer_num_blocks(piece.layer)
            if offset < 0 or stride < piece.size_bytes or offset % itemsize or stride % itemsize:
                raise LayoutMismatch(
                    f"{where}: offset {offset} / block stride {stride} unusable for "
                    f"{piece.size_bytes}-byte blocks"
                )
            if offset + (n - 1) * stride + piece.size_bytes > self.data_bytes:
                raise LayoutMismatch(f"{where}: ends past the {self.data_bytes}-byte region")


def encode_header(meta: dict[str, Any]) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    head = struct.pack(_HEADER_FORMAT, _MAGIC, _FORMAT_VERSION, len(body)) + body
    if len(head) > HEADER_BYTES:
        raise DeviceCacheError("device cache header does not fit in one page")
    return head


def read_header(fd: int, path: Path) -> dict[str, Any]:
    raw = os.pread(fd, HEADER_BYTES, 0)
    fixed = struct.calcsize(_HEADER_FORMAT)
    if len(raw) < fixed:
        raise DeviceCacheError(f"{path} is not a kvtier device cache (too short)")
    magic, version, length = struct.unpack_from(_HEADER_FORMAT, raw)
    if magic != _MAGIC or version != _FORMAT_VERSION or fixed + length > len(raw):
        raise DeviceCacheError(f"{path} is not a kvtier device cache (format {version})")
    try:
        meta = json.loads(raw[fixed : fixed + length])
    except ValueError as e:
        raise DeviceCacheError(f"{path} has a malformed header: {e}") from None
    if not isinstance(meta, dict) or "spec" not in meta or "device" not in meta:
        raise DeviceCacheError(f"{path} has a malformed header")
    return meta


def check_spec(spec: KVCacheSpec, meta: dict[str, Any], name: str) -> None:
    published = KVCacheSpec.from_dict(meta["spec"])
    diff = published.differences(spec)
    if diff:
        raise LayoutMismatch(
            f"device cache {name!r} was created with a different layout "
            f"(published != ours): {'; '.join(diff)}"
        )


def create_cpu(
    spec: KVCacheSpec, fd: int, layout: SegmentLayout
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    layout.check(spec)
    total = HEADER_BYTES + align(layout.data_bytes)
    shm.reserve(fd, total, "the device cache")
    meta = {
        "spec": spec.to_dict(),
        "device": "cpu",
        "owner_pid": os.getpid(),
        "bytes": total,
        "layout": [list(p) for p in layout.pieces],
        "data_bytes": layout.data_bytes,
    }
    os.pwrite(fd, encode_header(meta), 0)
    segment = shm.map_descriptor(fd, total)
    segment[HEADER_BYTES:].zero_()  # first touch now, not on the first swap
    return cpu_views(spec, segment, layout), segment


def cpu_views(
    spec: KVCacheSpec, segment: torch.Tensor, layout: SegmentLayout
) -> list[list[torch.Tensor]]:
    data = segment[HEADER_BYTES:]
    tensors: list[list[torch.Tensor]] = [[] for _ in range(spec.total_layers)]
    for piece, (offset, stride) in zip(spec.pieces, layout.pieces):
        dtype = spec.torch_dtype(piece.part)
        n = spec.layer_num_blocks(piece.layer)
        raw = data[offset : offset + (n - 1) * stride + piece.size_bytes]
        shape = spec.part_shape(piece.part, n)
        inner = [int(np.prod(shape[i + 1 :])) for i in range(1, len(shape))]
        view = raw.view(dtype).as_strided(shape, [stride // dtype.itemsize, *inner])
        tensors[piece.layer].append(view)
    return tensors
