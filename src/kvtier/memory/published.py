"""A device cache's published file: found by name (one kind per name), the CUDA IPC handle
table written, and a peer's attach — checked on the descriptor, the header's layout equal to the
spec, every tensor the spec's — before anything is mapped or opened by handle."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtier.errors import DeviceCacheError, LayoutMismatch
from kvtier.layout.spec import KVCacheSpec, Part
from kvtier.memory import shm
from kvtier.memory.segment import (
    HEADER_BYTES,
    SegmentLayout,
    check_spec,
    cpu_views,
    encode_header,
    read_header,
)
from kvtier.memory.shm import SegmentKind


def check_tensor(spec: KVCacheSpec, layer: int, part: Part, t: torch.Tensor) -> None:
    """Raise LayoutMismatch unless ``t`` is exactly the spec's tensor for (layer, part)."""
    want_shape = spec.part_shape(part, spec.layer_num_blocks(layer))
    where = f"layer {layer} {part.value}"
    if tuple(t.shape) != want_shape:
        raise LayoutMismatch(f"{where}: shape {tuple(t.shape)} != spec {want_shape}")
    if t.dtype != spec.torch_dtype(part):
        raise LayoutMismatch(f"{where}: dtype {t.dtype} != spec {spec.torch_dtype(part)}")
    # Each block must be one contiguous run of bytes (blocks may be strided apart).
    inner = t[0] if t.shape[0] else t
    if not inner.is_contiguous():
        raise LayoutMismatch(f"{where}: each block must be contiguous, strides {t.stride()}")


def find_published(name: str, device_type: str | None) -> Path:
    """The one published file of ``name``; two kinds under one name are refused (shadowing)."""
    kinds = {
        "cpu": [SegmentKind.CPU_CACHE],
        "cuda": [SegmentKind.CUDA_HANDLES],
        None: [SegmentKind.CPU_CACHE, SegmentKind.CUDA_HANDLES],
    }.get(device_type)
    if kinds is None:
        raise DeviceCacheError(f"device type {device_type!r} not supported: use cpu or cuda")
    found = [p for p in (shm.segment_path(name, k) for k in kinds) if os.path.lexists(p)]
    if len(found) > 1:
        raise DeviceCacheError(
            f"both {found[0].name} and {found[1].name} exist in {shm.SHM_DIR}: refusing to guess "
            "which is the device cache; remove the stale one"
        )
    if not found:
        raise DeviceCacheError(
            f"no device cache named {name!r} in {shm.SHM_DIR}: start the owner first or check "
            "the name"
        )
    return found[0]


def write_cuda_handles(fd: int, spec: KVCacheSpec, tensors: list[list[torch.Tensor]]) -> None:
    from kvtier.memory.cuda_ipc import encode_handles

    payload = encode_handles([t for row in tensors for t in row])
    meta = {
        "spec": spec.to_dict(),
        "device": str(tensors[0][0].device),
        "owner_pid": os.getpid(),
        "handles_bytes": len(payload),
    }
    head = encode_header(meta)
    os.ftruncate(fd, HEADER_BYTES + len(payload))
    os.pwrite(fd, head, 0)
    os.pwrite(fd, payload, HEADER_BYTES)


MAX_HANDLES_BYTES = 1 << 20


def attach_path(
    spec: KVCacheSpec, name: str, path: Path, check_owner: bool = True
) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    fd = shm.open_checked(path, f"device cache {name!r}")
    try:
        if check_owner and not shm.owner_alive(fd):
            raise DeviceCacheError(
                f"device cache {name!r} was left by a crashed owner; restart the owner"
            )
        meta = read_header(fd, path)
        check_spec(spec, meta, name)
        size = os.fstat(fd).st_size
        if meta["device"] == "cpu":
            try:
                layout = SegmentLayout(
                    tuple((int(o), int(s)) for o, s in meta["layout"]), int(meta["data_bytes"])
                )
                total = int(meta["bytes"])
            except (KeyError, TypeError, ValueError) as e:
                raise DeviceCacheError(f"{path} has a malformed layout: {e}") from None
            layout.check(spec)
            if size < total or total < HEADER_BYTES + layout.data_bytes:
                raise DeviceCacheError(f"{path} is truncated: {size} < {total} bytes")
            segment = shm.map_descriptor(fd, total)
            return cpu_views(spec, segment, layout), segment
        length = meta.get("handles_bytes")
        if not isinstance(length, int) or not 0 < length <= min(MAX_HANDLES_BYTES, size):
            raise DeviceCacheError(f"{path} has a malformed handle table")
        payload = os.pread(fd, length, HEADER_BYTES)
    finally:
        os.close(fd)
    from kvtier.memory.cuda_ipc import decode_handles

    flat = decode_handles(payload)
    if len(flat) != len(spec.pieces):
        raise LayoutMismatch(f"{path} holds {len(flat)} tensors; the spec has {len(spec.pieces)}")
    tensors: list[list[torch.Tensor]] = [[] for _ in range(spec.total_layers)]
    for piece, t in zip(spec.pieces, flat):
        check_tensor(spec, piece.layer, piece.part, t)
        tensors[piece.layer].append(t)
    return tensors, None
