"""Task and result messages between the engine's Client and the workers (msgspec, msgpack).

Every data task carries a ``task_id`` and is answered exactly once with a ``Result``. Storage
tasks name blocks by their chained block hashes (``kvtier.keys.block_hashes``); the worker turns
them into storage keys with its own namespace, weight version, layout fingerprint and rank.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class Status(str, Enum):
    OK = "ok"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    ERROR = "error"


# Fan-in: the status of a task over several ranks is the worst one.
STATUS_ORDER = {Status.OK: 0, Status.PARTIAL: 1, Status.CANCELLED: 2, Status.ERROR: 3}


class Direction(str, Enum):
    """Each has its own executor in the worker, FIFO within a direction."""

    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    SAVE = "save"
    LOAD = "load"
    HOST_IO = "host_io"  # save_host and load_host
    LOOKUP = "lookup"


class ControlMethod(str, Enum):
    PAUSE = "pause"
    RESUME = "resume"
    UPDATE_WEIGHTS = "update_weights"
    SLEEP = "sleep"
    WAKEUP = "wakeup"
    STATS = "stats"


class Code:
    """Control answers, HTTP-style."""

    OK = 200
    BAD_REQUEST = 400  # unknown method or bad arguments
    CONFLICT = 409  # not allowed in the current state
    FAILED = 500  # the handler raised


class SwapOut(msgspec.Struct, tag="swap_out", frozen=True):
    task_id: int
    device_block_ids: list[int]
    host_block_ids: list[int]


class SwapIn(msgspec.Struct, tag="swap_in", frozen=True):
    task_id: int
    host_block_ids: list[int]
    device_block_ids: list[int]


class Save(msgspec.Struct, tag="save", frozen=True):
    """Device -> storage, skipping the already-stored prefix."""

    task_id: int
    block_hashes: list[bytes]
    device_block_ids: list[int]


class Load(msgspec.Struct, tag="load", frozen=True):
    """Storage -> device: the longest stored prefix, cut at the first block that fails."""

    task_id: int
    block_hashes: list[bytes]
    device_block_ids: list[int]


class SaveHost(msgspec.Struct, tag="save_host", frozen=True):
    task_id: int
    block_hashes: list[bytes]
    host_block_ids: list[int]


class LoadHost(msgspec.Struct, tag="load_host", frozen=True):
    task_id: int
    block_hashes: list[bytes]
    host_block_ids: list[int]


class Lookup(msgspec.Struct, tag="lookup", frozen=True):
    """How many leading blocks are stored."""

    task_id: int
    block_hashes: list[bytes]


class Control(msgspec.Struct, tag="control", frozen=True):
    task_id: int
    method: str
    args: dict[str, Any] = {}


class Hello(msgspec.Struct, tag="hello", frozen=True):
    protocol_version: int
    client_id: str = ""


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    sent_at: float


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    task_id: int


class Result(msgspec.Struct, tag="result", frozen=True):
    """The one answer to a task. ``blocks``: swap tasks, the device (swap_out: host) ids done;
    load/save, the ids whose blocks now hold correct data (a prefix); lookup, empty and the
    count in ``count``. ``code`` answers control tasks; ``data`` carries stats."""

    task_id: int
    status: Status
    blocks: list[int] = []
    count: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    message: str = ""
    code: int = 0
    rank: int = -1
    data: dict[str, Any] = {}


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """The worker's answer to Hello."""

    protocol_version: int
    rank: int
    world_size: int
    accepted: bool
    message: str = ""
    pid: int = 0


DataTask = SwapOut | SwapIn | Save | Load | SaveHost | LoadHost | Lookup
Message = (
    SwapOut
    | SwapIn
    | Save
    | Load
    | SaveHost
    | LoadHost
    | Lookup
    | Control
    | Hello
    | Heartbeat
    | Shutdown
    | Result
    | Welcome
)
DATA_TASKS = (SwapOut, SwapIn, Save, Load, SaveHost, LoadHost, Lookup)

DIRECTIONS: dict[type, Direction] = {
    SwapOut: Direction.SWAP_OUT,
    SwapIn: Direction.SWAP_IN,
    Save: Direction.SAVE,
    Load: Direction.LOAD,
    SaveHost: Direction.HOST_IO,
    LoadHost: Direction.HOST_IO,
    Lookup: Direction.LOOKUP,
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on garbage; callers log and drop."""
    return _decoder.decode(data)


def task_name(task: Any) -> str:
    return type(task).__struct_config__.tag if hasattr(type(task), "__struct_config__") else "?"
