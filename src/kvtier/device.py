"""DeviceCache: the engine's per-layer K/V/scale tensors, created, attached by name, or wrapped.

Three ways to get one:

- ``DeviceCache.create(spec, name)`` — the owner allocates the cache and publishes it under
  ``name``: on CPU one named shared-memory segment in /dev/shm (a JSON header page, then every
  tensor page-aligned); on CUDA dedicated allocations whose IPC handles (torch's own CUDA-IPC
  reductions, which carry the storage offset) are published in a small /dev/shm file.
- ``DeviceCache.attach(spec, name)`` — a peer process maps the published cache; the layout in the
  header must equal ``spec`` field by field, otherwise ``LayoutMismatch`` names the fields.
- ``DeviceCache.wrap(spec, key_caches, value_caches, ...)`` — in process, tensors the engine
  already has (torch tensors or anything with ``__dlpack__``). ``publish(name)`` shares wrapped
  CUDA tensors with a worker.

The owner holds an exclusive ``flock`` on the published file for its lifetime. A file whose lock
can be taken therefore belongs to a crashed owner: ``create`` reclaims it (one WARNING line) and
``attach`` refuses it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import re
import struct
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.errors import DeviceCacheDetached, DeviceCacheError, LayoutMismatch
from kvtier.spec import KVCacheSpec, Part

log = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("KVTIER_SHM_DIR", "/dev/shm"))
HEADER_BYTES = 4096
ALIGN_BYTES = 4096
_MAGIC = b"KVTIERDC"
_HEADER_FORMAT = "<8sII"  # magic, format version, json length
_FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class CacheMode(str, Enum):
    OWNER = "owner"
    ATTACHED = "attached"
    WRAPPED = "wrapped"


def cache_name(instance_id: str, rank: int, device_index: int = 0) -> str:
    """The published name of one rank's device cache: the instance id keeps engines apart."""
    name = f"kvtier-{instance_id}-rank{rank}-dev{device_index}"
    _check_name(name)
    return name


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise DeviceCacheError(
            f"device cache name {name!r} must be 1-200 characters of letters, digits, '.', '_', '-'"
        )


def _segment_path(name: str, device_type: str) -> Path:
    return SHM_DIR / (f"{name}.kvcache" if device_type == "cpu" else f"{name}.cudaipc")


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _cpu_offsets(spec: KVCacheSpec) -> list[tuple[int, Part, int, int]]:
    """(layer, part, offset, bytes) of every tensor in a CPU segment, page-aligned."""
    out = []
    offset = HEADER_BYTES
    for layer in range(spec.total_layers):
        for part in spec.parts:
            nbytes = spec.layer_num_blocks(layer) * spec.part_block_bytes(part)
            out.append((layer, part, offset, nbytes))
            offset = _align(offset + nbytes)
    return out


def _as_torch(t: Any, what: str) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    raise LayoutMismatch(f"{what} is a {type(t).__name__}: need a torch tensor or a DLPack tensor")


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


class DeviceCache:
    """Per-layer device tensors of one rank, addressed as ``tensor(layer, part)``.

    Not thread-safe for detach/attach against concurrent copies: the worker's control path
    stops data tasks before it sleeps or wakes.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        tensors: list[list[torch.Tensor]],
        *,
        mode: CacheMode,
        name: str | None = None,
        lock_fd: int | None = None,
        segment: torch.Tensor | None = None,
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.name = name
        self._tensors: list[list[torch.Tensor]] | None = tensors
        self._lock_fd = lock_fd
        self._segment = segment  # keeps the CPU mapping alive
        self._published_path: Path | None = None
        self.generation = 0  # bumped on every detach/attach so users can drop cached pointers
        self._piece_table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.device = tensors[0][0].device

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def create(
        cls, spec: KVCacheSpec, name: str, device: str | torch.device = "cpu"
    ) -> DeviceCache:
        """Allocate the cache, zero it, and publish it under ``name`` (this process owns it)."""
        _check_name(name)
        dev = torch.device(device)
        path = _segment_path(name, dev.type)
        fd = _open_exclusive(path, name)
        try:
            if dev.type == "cpu":
                tensors, segment = _create_cpu(spec, fd, path)
                cache = cls(
                    spec, tensors, mode=CacheMode.OWNER, name=name, lock_fd=fd, segment=segment
                )
            elif dev.type == "cuda":
                tensors = [
                    [
                        torch.zeros(
                            spec.part_shape(p, spec.layer_num_blocks(layer)),
                            dtype=spec.torch_dtype(p),
                            device=dev,
                        )
                        for p in spec.parts
                    ]
                    for layer in range(spec.total_layers)
                ]
                _write_cuda_handles(fd, spec, tensors)
                cache = cls(spec, tensors, mode=CacheMode.OWNER, name=name, lock_fd=fd)
            else:
                raise DeviceCacheError(f"device type {dev.type!r} not supported: use cpu or cuda")
        except BaseException:
            _unlink_quietly(path)
            os.close(fd)
            raise
        cache._published_path = path
        log.info("created device cache %s (%s, %d bytes)", name, dev, spec.device_bytes)
        return cache

    @classmethod
    def attach(cls, spec: KVCacheSpec, name: str, device_type: str | None = None) -> DeviceCache:
        """Map a cache that another process created or published under ``name``."""
        _check_name(name)
        path = _find_published(name, device_type)
        tensors, segment = _attach_path(spec, name, path)
        cache = cls(spec, tensors, mode=CacheMode.ATTACHED, name=name, segment=segment)
        log.info("attached device cache %s (%s)", name, cache.device)
        return cache

    @classmethod
    def wrap(
        cls,
        spec: KVCacheSpec,
        key_caches: Sequence[Any],
        value_caches: Sequence[Any] | None = None,
        key_scales: Sequence[Any] | None = None,
        value_scales: Sequence[Any] | None = None,
    ) -> DeviceCache:
        """Use tensors the engine already has: one list entry per layer (main, then extra)."""
        given = {
            Part.KEY: key_caches,
            Part.VALUE: value_caches,
            Part.KEY_SCALE: key_scales,
            Part.VALUE_SCALE: value_scales,
        }
        for part, seq in given.items():
            if part not in spec.parts and seq:
                raise LayoutMismatch(f"{part.value} tensors given but the spec has no {part.value}")
            if part in spec.parts and (seq is None or len(seq) != spec.total_layers):
                got = "none" if seq is None else str(len(seq))
                raise LayoutMismatch(
                    f"{part.value}: need {spec.total_layers} tensors (one per layer), got {got}"
                )
        tensors: list[list[torch.Tensor]] = []
        for layer in range(spec.total_layers):
            row = []
            for part in spec.parts:
                t = _as_torch(given[part][layer], f"layer {layer} {part.value}")  # type: ignore[index]
                check_tensor(spec, layer, part, t)
                row.append(t)
            tensors.append(row)
        devices = {t.device for row in tensors for t in row}
        if len(devices) != 1:
            raise LayoutMismatch(
                f"all tensors must be on one device, got {sorted(map(str, devices))}"
            )
        return cls(spec, tensors, mode=CacheMode.WRAPPED)

    def publish(self, name: str) -> None:
        """Publish wrapped CUDA tensors so a worker can ``attach`` them by ``name``."""
        _check_name(name)
        if self.mode is not CacheMode.WRAPPED or self.device.type != "cuda":
            raise DeviceCacheError(
                "publish() shares wrapped CUDA tensors; on CPU create the cache with "
                "DeviceCache.create so it lives in shared memory"
            )
        path = _segment_path(name, "cuda")
        fd = _open_exclusive(path, name)
        try:
            _write_cuda_handles(fd, self.spec, self.tensors)
        except BaseException:
            _unlink_quietly(path)
            os.close(fd)
            raise
        self.name, self._lock_fd, self._published_path = name, fd, path

    # ---- access -----------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._tensors is not None

    @property
    def tensors(self) -> list[list[torch.Tensor]]:
        """``tensors[layer][i]`` is the tensor of ``spec.parts[i]``."""
        if self._tensors is None:
            raise DeviceCacheDetached(f"device cache {self.name or '(wrapped)'} is detached")
        return self._tensors

    @property
    def segment(self) -> torch.Tensor | None:
        """The raw uint8 mapping of a CPU shared-memory cache (header page included), else None."""
        return self._segment

    def tensor(self, layer: int, part: Part) -> torch.Tensor:
        return self.tensors[layer][self.spec.parts.index(part)]

    def piece_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (layer, part) in page-first order: base address, block stride, block bytes."""
        if self._piece_table is None:
            tensors = [t for row in self.tensors for t in row]
            base = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
            stride = np.array([t.stride(0) * t.element_size() for t in tensors], dtype=np.int64)
            size = np.array([p.size_bytes for p in self.spec.pieces], dtype=np.int64)
            self._piece_table = (base, stride, size)
        return self._piece_table

    # ---- lifecycle --------------------------------------------------------------------------

    def detach(self) -> None:
        """Drop this process's mapping (sleep). Views taken earlier keep their memory alive."""
        self._tensors = None
        self._segment = None
        self._piece_table = None
        self.generation += 1

    def reattach(self) -> None:
        """Map the published cache again (wakeup), checking the layout against the spec."""
        if self._tensors is not None:
            return
        if self.mode is CacheMode.WRAPPED and self._published_path is None:
            raise DeviceCacheError(
                "a wrapped cache cannot re-attach: wrap the engine's tensors again"
            )
        assert self.name is not None
        path = self._published_path or _find_published(self.name, self.device.type)
        self._tensors, self._segment = _attach_path(
            self.spec, self.name, path, check_owner=self._lock_fd is None
        )
        self._piece_table = None
        self.generation += 1

    def close(self) -> None:
        """Detach; the owner (or publisher) also unlinks its name."""
        self.detach()
        if self._lock_fd is not None:
            if self._published_path is not None:
                _unlink_quietly(self._published_path)
            os.close(self._lock_fd)
            self._lock_fd = None
            log.info("closed device cache %s and unlinked it", self.name)

    def __enter__(self) -> DeviceCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return f"DeviceCache({self.name or '(wrapped)'}, {self.mode.value}, {self.device}, {state})"


# ---- published files ------------------------------------------------------------------------


def _open_exclusive(path: Path, name: str) -> int:
    """Create ``path`` exclusively and lock it; reclaim it if a crashed owner left it."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            old = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(old)
                raise DeviceCacheError(
                    f"device cache {name!r} is owned by a running process; "
                    "use another instance id or stop that engine"
                ) from None
            log.warning("reclaiming device cache %s left by a crashed owner (%s)", name, path)
            _unlink_quietly(path)
            os.close(old)
            continue
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    raise DeviceCacheError(f"could not create {path}: another process keeps re-creating it")


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _find_published(name: str, device_type: str | None) -> Path:
    kinds = [device_type] if device_type else ["cpu", "cuda"]
    for kind in kinds:
        path = _segment_path(name, kind)
        if path.exists():
            return path
    raise DeviceCacheError(
        f"no device cache named {name!r} in {SHM_DIR}: start the owner first or check the name"
    )


def _encode_header(meta: dict[str, Any]) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    head = struct.pack(_HEADER_FORMAT, _MAGIC, _FORMAT_VERSION, len(body)) + body
    if len(head) > HEADER_BYTES:
        raise DeviceCacheError("device cache header does not fit in one page")
    return head


def _read_header(fd: int, path: Path) -> tuple[dict[str, Any], int]:
    raw = os.pread(fd, HEADER_BYTES, 0)
    fixed = struct.calcsize(_HEADER_FORMAT)
    if len(raw) < fixed:
        raise DeviceCacheError(f"{path} is not a kvtier device cache (too short)")
    magic, version, length = struct.unpack_from(_HEADER_FORMAT, raw)
    if magic != _MAGIC or version != _FORMAT_VERSION or fixed + length > len(raw):
        raise DeviceCacheError(f"{path} is not a kvtier device cache (format {version})")
    return json.loads(raw[fixed : fixed + length]), fixed + length


def _check_spec(spec: KVCacheSpec, meta: dict[str, Any], name: str) -> None:
    published = KVCacheSpec.from_dict(meta["spec"])
    diff = published.differences(spec)
    if diff:
        raise LayoutMismatch(
            f"device cache {name!r} was created with a different layout "
            f"(published != ours): {'; '.join(diff)}"
        )


def _create_cpu(
    spec: KVCacheSpec, fd: int, path: Path
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    layout = _cpu_offsets(spec)
    total = _align(layout[-1][2] + layout[-1][3])
    os.ftruncate(fd, total)
    meta = {"spec": spec.to_dict(), "device": "cpu", "owner_pid": os.getpid(), "bytes": total}
    os.pwrite(fd, _encode_header(meta), 0)
    segment = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    tensors = _cpu_views(spec, segment)
    for row in tensors:
        for t in row:
            t.zero_()  # first touch now, not on the first swap
    return tensors, segment


def _cpu_views(spec: KVCacheSpec, segment: torch.Tensor) -> list[list[torch.Tensor]]:
    tensors: list[list[torch.Tensor]] = [[] for _ in range(spec.total_layers)]
    for layer, part, offset, nbytes in _cpu_offsets(spec):
        raw = segment[offset : offset + nbytes]
        view = raw.view(spec.torch_dtype(part)).view(
            spec.part_shape(part, spec.layer_num_blocks(layer))
        )
        tensors[layer].append(view)
    return tensors


def _write_cuda_handles(fd: int, spec: KVCacheSpec, tensors: list[list[torch.Tensor]]) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    # reduce_tensor records the storage handle *and* the tensor's offset inside it, so a tensor
    # sub-allocated by the caching allocator is rebuilt at the right address.
    handles = [[reduce_tensor(t) for t in row] for row in tensors]
    payload = pickle.dumps(handles)
    meta = {
        "spec": spec.to_dict(),
        "device": str(tensors[0][0].device),
        "owner_pid": os.getpid(),
        "handles_bytes": len(payload),
    }
    head = _encode_header(meta)
    os.ftruncate(fd, HEADER_BYTES + len(payload))
    os.pwrite(fd, head, 0)
    os.pwrite(fd, payload, HEADER_BYTES)


def _attach_path(
    spec: KVCacheSpec, name: str, path: Path, check_owner: bool = True
) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise DeviceCacheError(
            f"device cache {name!r} is gone ({path}); its owner closed it"
        ) from None
    try:
        if check_owner:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # the owner holds its lock: alive
            else:
                raise DeviceCacheError(
                    f"device cache {name!r} was left by a crashed owner; restart the owner"
                )
        meta, _ = _read_header(fd, path)
        _check_spec(spec, meta, name)
        if meta["device"] == "cpu":
            size = os.fstat(fd).st_size
            if size < meta["bytes"]:
                raise DeviceCacheError(f"{path} is truncated: {size} < {meta['bytes']} bytes")
            segment = torch.from_file(str(path), shared=True, size=meta["bytes"], dtype=torch.uint8)
            return _cpu_views(spec, segment), segment
        payload = os.pread(fd, meta["handles_bytes"], HEADER_BYTES)
    finally:
        os.close(fd)
    handles = pickle.loads(payload)  # written by the owner, 0600, same user
    tensors = [[fn(*args) for fn, args in row] for row in handles]
    for layer, row in enumerate(tensors):
        for part, t in zip(spec.parts, row):
            check_tensor(spec, layer, part, t)
    return tensors, None
