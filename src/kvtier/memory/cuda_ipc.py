"""CUDA IPC handles of device tensors, in a fixed, non-executable encoding.

torch's ``reduce_tensor`` yields, for a CUDA tensor, the fields that rebuild it in another
process: the allocation's IPC handle, the storage's offset inside that allocation (the caching
allocator sub-allocates), the tensor's offset, size and stride, and the reference-counter and
event handles. They are written as a msgpack struct of plain ints, bytes and a dtype name and
rebuilt with ``rebuild_cuda_tensor`` — never unpickled, so a planted file cannot run code.
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kvtier.errors import DeviceCacheError

_DTYPES = {
    str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8)
}


class TensorHandle(msgspec.Struct, frozen=True):
    size: list[int]
    stride: list[int]
    tensor_offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class HandleTable(msgspec.Struct, frozen=True):
    """One handle per (layer, part), in the spec's page-first order."""

    tensors: list[TensorHandle]


def encode_handles(tensors: list[torch.Tensor]) -> bytes:

    out = []
    for t in tensors:
        fn, args = reduce_tensor(t)
        if fn is not rebuild_cuda_tensor:
            raise DeviceCacheError(f"cannot share a {t.device} tensor by CUDA IPC handle")
        (_, size, stride, offset, _, dtype, device, handle, size_b, offset_b) = args[:10]
        (_, rc_handle, rc_offset, event, event_sync) = args[10:15]
        out.append(
            TensorHandle(
                list(size),
                list(stride),
                int(offset),
                str(dtype),
                int(device),
                bytes(handle),
                int(size_b),
                int(offset_b),
                bytes(rc_handle),
                int(rc_offset),
                None if event is None else bytes(event),
                bool(event_sync),
            )
        )
    return msgspec.msgpack.encode(HandleTable(out))


def decode_handles(payload: bytes) -> list[torch.Tensor]:
    """Rebuild the tensors; raises DeviceCacheError on anything that is not a handle table."""

    try:
        table = msgspec.msgpack.decode(payload, type=HandleTable)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DeviceCacheError(f"CUDA IPC handle file is malformed: {e}") from None
    tensors = []
    for h in table.tensors:
        dtype = _DTYPES.get(h.dtype)
        if dtype is None:
            raise DeviceCacheError(f"CUDA IPC handle has an unknown dtype {h.dtype!r}")
        tensors.append(
            rebuild_cuda_tensor(
                torch.Tensor,
                torch.Size(h.size),
                tuple(h.stride),
                h.tensor_offset,
                torch.UntypedStorage,
                dtype,
                h.device,
                h.handle,
                h.storage_size_bytes,
                h.storage_offset_bytes,
                False,
                h.ref_counter_handle,
                h.ref_counter_offset,
                h.event_handle,
                h.event_sync_required,
            )
        )
    return tensors
