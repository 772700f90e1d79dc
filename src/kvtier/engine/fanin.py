"""Fan-in: one answer from every rank's (aggregate), and what a submitted task returns.

Every task goes to every rank; each rank answers for its own shard. The engine needs one
answer: the blocks every rank holds (the shortest prefix), the worst status, the bytes moved
by all ranks together.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.transport import tasks as t


class TaskFuture(Future):
    """A Future of an aggregated Result; ``per_rank`` holds every rank's own answer."""

    per_rank: dict[int, t.Result]

    def __init__(self) -> None:
        super().__init__()
        self.per_rank = {}


@dataclass(frozen=True)
class ControlAnswer:
    """A control request's answer over all ranks: the worst code, and each rank's answer."""

    code: t.Code
    message: str
    per_rank: dict[int, t.Result]


def aggregate(task: Any, results: dict[int, t.Result]) -> t.Result:
    """One answer from every rank's: shortest prefix of blocks, worst status, summed bytes.

    ``bytes_moved`` is the sum over ranks (each rank moves its own shard); ``seconds`` the
    slowest rank; ``count`` (lookup: found; save: already stored) the smallest; ``code``
    (control) the worst; ``removed`` blocks the union; ``tiers`` (lookup) per block the slowest.
    """
    if len(results) == 1:  # one rank (every call of a TP=1 engine): its answer, relabelled
        (only,) = results.values()
        return msgspec.structs.replace(
            only,
            task_id=task.task_id,
            rank=-1,
            message=f"rank {only.rank}: {only.message}" if only.message else "",
            removed=list(dict.fromkeys(only.removed)) if only.removed else [],
            tiers=_slowest_tiers([only]) if only.tiers else b"",
        )
    ordered = [results[r] for r in sorted(results)]
    worst = max(ordered, key=lambda res: t.STATUS_ORDER[res.status])
    shortest = min((res.blocks for res in ordered), key=len)
    messages = [f"rank {res.rank}: {res.message}" for res in ordered if res.message]
    return t.Result(
        task_id=task.task_id,
        status=worst.status,
        blocks=list(shortest),
        count=min(res.count for res in ordered),
        bytes_moved=sum(res.bytes_moved for res in ordered),
        seconds=max(res.seconds for res in ordered),
        message="; ".join(messages),
        code=max((res.code for res in ordered), default=t.Code.NONE),
        rank=-1,
        # a block is gone from the store once any rank's part of it is
        removed=list(dict.fromkeys(h for res in ordered for h in res.removed)),
        all_removed=any(res.all_removed for res in ordered),
        tiers=_slowest_tiers(ordered),
    )


def _slowest_tiers(ordered: list[t.Result]) -> bytes:
    """A lookup's tier per block over ranks: the slowest rank's (a load waits for every rank),
    over the blocks every rank holds."""
    if not any(res.tiers for res in ordered):
        return b""
    count = min(res.count for res in ordered)
    per_rank = [res.tiers[:count].ljust(count, b"\0") for res in ordered]
    return bytes(max(levels) for levels in zip(*per_rank))
