"""Task and result messages between the engine's Client and the workers (msgspec, msgpack).

Every data task carries a ``task_id`` and is answered exactly once with a ``Result``. Storage
tasks name blocks by their chained block hashes (``kvtier.layout.keys.block_hashes``, or an
engine's own hashes of 16..64 bytes); the worker turns them into storage keys with its own
namespace, weight version, layout fingerprint and rank.

Messages are built by keyword (``SwapOut(device_block_ids=[1], host_block_ids=[0])``); the
client assigns ``task_id`` when it submits. Every field has a bounded, shallow type: a decoded
message can never nest deeper than three levels, whatever a peer sends.
"""

from __future__ import annotations

import typing
from enum import Enum, IntEnum
from typing import Annotated, Any

import msgspec

PROTOCOL_VERSION = 4  # 3: tcp:// peers authenticate by CURVE; no secret in the hello. 4: bundles
# Bounds on what one message may carry; a message beyond them is refused before it is decoded.
# 65,536 blocks per task is 8 M tokens at 128-token blocks (any step of any engine); such a task
# encodes to < 3 MiB (32-byte hashes). The message bound is also what a peer that has not yet
# authenticated can make libzmq buffer per connection: keep it small.
MAX_IDS_PER_TASK = 1 << 16
MAX_MESSAGE_BYTES = 4 << 20
MAX_TEXT_CHARS = 4096  # control arguments, messages, client ids
# A bundle carries at most this many messages (each bounded as if sent alone; the whole frame
# within MAX_MESSAGE_BYTES). Its messages are handled and answered one by one, in order.
MAX_BUNDLE_ITEMS = 256

BlockIds = Annotated[list[int], msgspec.Meta(max_length=MAX_IDS_PER_TASK)]
# A data task's ``timeout_ms``: the time its client had left when it sent it (0: no deadline).
# The worker never touches the task's blocks once the client may have given up on it
# (``kvtier.worker.deadline``): the engine reuses blocks whose task timed out.
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000
TimeoutMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIMEOUT_MS)]
BlockHashes = Annotated[
    list[Annotated[bytes, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=MAX_IDS_PER_TASK)
]


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
    # The engine's load-or-recompute estimates (``kvtier.vllm.decide``), sent by its rank 0 now
    # and then: the worker only keeps them, for its exporter and ``stats``.
    ESTIMATES = "estimates"


class Code(IntEnum):
    """Control answers, HTTP-style."""

    NONE = 0  # not a control task
    OK = 200
    BAD_REQUEST = 400  # unknown method or bad arguments
    CONFLICT = 409  # not allowed in the current state
    FAILED = 500  # the handler raised


Scalar = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] | int | float | bool | None
# Stats and control answers: at most three levels (e.g. tasks -> kind -> counter).
Data = dict[str, Scalar | dict[str, Scalar | dict[str, int]]]


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    pass


class SwapOut(_Message, tag="swap_out", frozen=True, kw_only=True):
    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    device_block_ids: BlockIds
    host_block_ids: BlockIds


class SwapIn(_Message, tag="swap_in", frozen=True, kw_only=True):
    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    host_block_ids: BlockIds
    device_block_ids: BlockIds


class Save(_Message, tag="save", frozen=True, kw_only=True):
    """Device -> storage, skipping the already-stored prefix."""

    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    block_hashes: BlockHashes
    device_block_ids: BlockIds


class Load(_Message, tag="load", frozen=True, kw_only=True):
    """Storage -> device: the longest stored prefix, cut at the first block that fails."""

    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    block_hashes: BlockHashes
    device_block_ids: BlockIds


class SaveHost(_Message, tag="save_host", frozen=True, kw_only=True):
    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    block_hashes: BlockHashes
    host_block_ids: BlockIds


class LoadHost(_Message, tag="load_host", frozen=True, kw_only=True):
    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    block_hashes: BlockHashes
    host_block_ids: BlockIds


class Lookup(_Message, tag="lookup", frozen=True, kw_only=True):
    """How many leading blocks are stored."""

    task_id: int = 0
    timeout_ms: TimeoutMs = 0
    block_hashes: BlockHashes


class Control(_Message, tag="control", frozen=True, kw_only=True):
    task_id: int = 0
    method: str
    args: dict[str, Scalar] = {}


class Hello(_Message, tag="hello", frozen=True, kw_only=True):
    protocol_version: int
    client_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    observer: bool = False  # a status tool: may ask for stats only, keeps nothing alive


class Heartbeat(_Message, tag="heartbeat", frozen=True, kw_only=True):
    sent_at: float
    # A worker's echo: its running save, once blocked on its store (neither running nor waiting
    # for a core) for ``save_blocked_s`` — a slow store shown before the save is answered
    # (``kvtier.vllm.decide``); 0 when no save runs or it is not blocked.
    save_blocked_s: float = 0.0
    save_blocks: int = 0


class Shutdown(_Message, tag="shutdown", frozen=True, kw_only=True):
    task_id: int = 0


class Result(_Message, tag="result", frozen=True, kw_only=True):
    """The one answer to a task.

    ``blocks``: swap tasks, the device (swap_out: host) ids done; load/save, the ids whose blocks
    now hold correct data (a prefix); lookup, empty and the count in ``count``; save and
    save_host, in ``count`` how many of ``blocks`` were already stored (skipped, not written).
    ``code`` answers control tasks; ``data`` carries stats and control details.
    ``bytes_moved`` counts bytes actually copied or transferred (a skipped, already-stored
    block moves nothing).
    """

    task_id: int
    status: Status
    blocks: BlockIds = []
    count: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    # Of ``seconds``, the time the task's thread waited for a core (storage transfers; saves
    # run on a niced thread) — a busy machine's time, not the store's (``kvtier.vllm.decide``).
    cpu_wait_s: float = 0.0
    message: str = ""
    code: Code = Code.NONE
    rank: int = -1
    data: Data = {}
    # Save and load results: blocks whose stored objects this rank removed since its previous
    # such result (evicted), or all of them (a weight update) — ``kvtier.worker.removals``.
    removed: BlockHashes = []
    all_removed: bool = False
    # Lookup on a tier chain: the tier (0 = fastest) each of the ``count`` blocks would load
    # from, one byte each; empty when every one comes from the first tier (``kvtier.storage``).
    tiers: Annotated[bytes, msgspec.Meta(max_length=MAX_IDS_PER_TASK)] = b""


class Welcome(_Message, tag="welcome", frozen=True, kw_only=True):
    """The worker's answer to Hello."""

    protocol_version: int
    rank: int
    world_size: int
    accepted: bool
    message: str = ""
    pid: int = 0


class Bundle(_Message, tag="bundle", frozen=True, kw_only=True):
    """Several messages for one peer in one frame, each encoded alone, handled and answered
    one by one as if sent apart. A sender bundles what queued up while it was busy (a window of
    lookups, a turn's answers): one send, one wake and one receive for all of them, where each
    message alone costs tens of microseconds of the transport. Never nested."""

    items: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BUNDLE_ITEMS)]


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
    | Bundle
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


def _list_fields(kind: type) -> tuple[str, ...]:
    def is_list(tp: Any) -> bool:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        return typing.get_origin(tp) is list

    return tuple(f.name for f in msgspec.structs.fields(kind) if is_list(f.type))


# Per data task type, its list fields (block ids and hashes): what a task weighs.
LIST_FIELDS: dict[type, tuple[str, ...]] = {kind: _list_fields(kind) for kind in DATA_TASKS}


def id_count(task: Any) -> int:
    """The block ids and hashes a data task carries: what it makes a worker hold."""
    count = 0
    for name in LIST_FIELDS[type(task)]:
        count += len(getattr(task, name))
    return count


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on anything that is not a message.

    A value nested deeper than the interpreter's recursion limit (in a field the schema skips)
    is a DecodeError too: no single message can take down the loop that decodes it.
    """
    try:
        return _decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("message nested too deeply") from None


def decode_frame(data: bytes) -> list[Message]:
    """The messages one frame carries: itself, or a bundle's in order. Raises as ``decode``
    (a bundle inside a bundle is a ValidationError)."""
    message = decode(data)
    if not isinstance(message, Bundle):
        return [message]
    items = [decode(bytes(raw)) for raw in message.items]
    if any(isinstance(item, Bundle) for item in items):
        raise msgspec.ValidationError("a bundle inside a bundle")
    return items


# What a bundle adds to its messages: the struct's header and the list's (a Raw is embedded as
# it was encoded). Generous: a frame never passes the bound.
_BUNDLE_OVERHEAD = 64


def bundle(payloads: list[bytes]) -> list[bytes]:
    """Frames that carry ``payloads`` (encoded messages) in order: one alone as it is, more in
    bundles within MAX_BUNDLE_ITEMS and MAX_MESSAGE_BYTES."""
    if len(payloads) < 2:
        return payloads
    frames: list[bytes] = []
    group: list[bytes] = []
    size = _BUNDLE_OVERHEAD
    for payload in payloads:
        if group and (len(group) == MAX_BUNDLE_ITEMS or size + len(payload) > MAX_MESSAGE_BYTES):
            frames.append(_bundled(group))
            group, size = [], _BUNDLE_OVERHEAD
        group.append(payload)
        size += len(payload)
    frames.append(_bundled(group))
    return frames


def _bundled(group: list[bytes]) -> bytes:
    if len(group) == 1:
        return group[0]
    return _encoder.encode(Bundle(items=[msgspec.Raw(p) for p in group]))


def peek_task_id(data: bytes) -> int | None:
    """The ``task_id`` of a message that failed to decode, if one can be read safely.

    Only a top-level map is looked at, with every value decoded as an opaque raw slice, so a
    malformed message of any depth costs one shallow pass. Its keys may be anything msgpack
    allows (an array key made the whole message unreadable, and a task that carried its id
    went unanswered: found by the socket fuzz test).
    """
    try:
        raw = msgspec.msgpack.decode(data, type=dict[Any, msgspec.Raw])
        task_id = msgspec.msgpack.decode(raw["task_id"], type=int)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError, RecursionError):
        return None
    return task_id if isinstance(task_id, int) and not isinstance(task_id, bool) else None


def task_name(task: Any) -> str:
    config = getattr(type(task), "__struct_config__", None)
    return str(config.tag) if config is not None else "?"
