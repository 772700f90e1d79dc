"""The demo workload: an engine serving multi-turn chats through CacheIndex and the Client.

Users share a system prompt and come back turn after turn with their growing history, while
the device cache is far smaller than the working set: earlier turns must come back from host
or storage, or be recomputed. Every block's bytes are a deterministic function of (block hash,
rank), so each block swapped in or loaded is checked byte for byte.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.common.interrupts import CleanupStack
from kvtier.engine.client import Client
from kvtier.engine.index import CacheIndex, Plan, SaveHostEviction, SwapOutEviction, Tier
from kvtier.errors import ConfigError
from kvtier.layout.spec import CacheDType, KVCacheSpec
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.transport.tasks import Result


@dataclass
class Workload:
    users: int = 16
    turns: int = 6
    system_tokens: int = 512
    user_tokens: int = 48  # a new user message
    reply_tokens: int = 80  # the assistant's answer, part of the next turn's history
    block_size: int = 16
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    device_blocks: int = 160
    host_blocks: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        limits = {
            "users": (1, 10_000),
            "turns": (1, 1_000),
            "block_size": (1, 4096),
            "device_blocks": (1, 1 << 22),
            "host_blocks": (0, 1 << 22),
        }
        for name, (low, high) in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(name, f"must be an integer in {low}..{high}, got {value!r}")
        longest = -(-self.longest_prompt_tokens // self.block_size)
        if longest > self.device_blocks:  # it failed at that turn, after minutes of work
            per_turn = self.user_tokens + self.reply_tokens
            fits = (self.device_blocks * self.block_size - self.system_tokens) // per_turn
            fewer = f"--turns {fits} or fewer, or " if fits >= 1 else ""
            raise ConfigError(
                "turns",
                f"the last turn's prompt is {longest} blocks, more than the device cache's "
                f"{self.device_blocks}: use {fewer}--device-blocks {longest} or more",
            )

    @property
    def longest_prompt_tokens(self) -> int:
        """The system prompt and one user's whole history: the last turn's prompt."""
        return self.system_tokens + self.turns * (self.user_tokens + self.reply_tokens)

    @classmethod
    def from_args(cls, args: Any) -> Workload:
        """From parsed CLI options (users, turns, device_blocks, host_blocks, seed, ...)."""
        names = ("users", "turns", "device_blocks", "host_blocks", "seed", "block_size")
        return cls(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})

    def working_set_blocks(self) -> int:
        """Blocks the whole workload touches: the shared system prompt once, then each user's
        history (messages and replies) at its longest."""
        history = self.turns * (self.user_tokens + self.reply_tokens)
        return self.system_tokens // self.block_size + self.users * -(-history // self.block_size)

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.layers,
            num_blocks=self.device_blocks,
            num_kv_heads=self.heads,
            block_size=self.block_size,
            head_dim=self.head_dim,
            dtype=CacheDType.BFLOAT16,
        )


@dataclass
class Tally:
    requests: int = 0
    prefill_tokens: int = 0
    tokens: Counter = field(default_factory=Counter)  # by source tier
    bytes: Counter = field(default_factory=Counter)  # by task kind
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per kind
    verified: int = 0
    checked: int = 0

    def as_dict(self) -> dict[str, Any]:
        per_request = sum(self.seconds.values()) / max(1, self.requests)
        return {
            "requests": self.requests,
            "prefill_tokens": self.prefill_tokens,
            "tokens": {t.value: self.tokens[t] for t in Tier},
            "prefill_avoided": (
                1 - self.tokens[Tier.COMPUTE] / self.prefill_tokens if self.prefill_tokens else 0.0
            ),
            "bytes": dict(self.bytes),
            "seconds": dict(self.seconds),
            "gbps": {
                k: self.bytes[k] / self.seconds[k] / 1e9 for k in self.bytes if self.seconds[k] > 0
            },
            "kvtier_ms_per_request": per_request * 1e3,
            "blocks_verified": self.verified,
            "blocks_checked": self.checked,
        }


def block_content(block_hash: bytes, rank: int, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(block_hash + bytes([rank])).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Engine:
    """Simulates the engine: writes computed blocks, runs plans through the client, checks."""

    def __init__(
        self, workload: Workload, client: Client, caches: list[DeviceCache], index: CacheIndex
    ) -> None:
        self.w, self.client, self.caches, self.index = workload, client, caches, index
        self.spec = caches[0].spec
        self.tally = Tally()

    def _write(self, block_hash: bytes, device: int) -> None:
        for rank, cache in enumerate(self.caches):
            data = block_content(block_hash, rank, self.spec.block_bytes)
            offset = 0
            for row in cache.tensors:
                for tensor in row:
                    raw = tensor[device].view(-1).view(torch.uint8)
                    n = raw.numel()
                    raw.copy_(torch.from_numpy(data[offset : offset + n]))
                    offset += n

    def _check(self, block_hash: bytes, device: int) -> bool:
        for rank, cache in enumerate(self.caches):
            data = block_content(block_hash, rank, self.spec.block_bytes)
            offset = 0
            for row in cache.tensors:
                for tensor in row:
                    raw = tensor[device].view(-1).view(torch.uint8).numpy()
                    if not np.array_equal(raw, data[offset : offset + raw.size]):
                        return False
                    offset += raw.size
        return True

    def _call(self, kind: str, fn, *args) -> Result:
        start = time.perf_counter()
        result = fn(*args)
        self.tally.seconds[kind] += time.perf_counter() - start
        self.tally.bytes[kind] += result.bytes_moved
        return result

    def serve(self, request_id: str, tokens: list[int]) -> None:
        plan = self.index.plan(request_id, tokens)
        self._evict(plan)
        if plan.swap_ins:
            hosts, devices = zip(*plan.swap_ins)
            res = self._call("swap_in", self.client.swap_in, list(hosts), list(devices))
            self.index.apply_swap_in(plan, res.status.value == "ok")
        if plan.loads:
            hashes, devices = zip(*plan.loads)
            res = self._call("load", self.client.load, list(hashes), list(devices))
            self.index.apply_load(plan, len(res.blocks))
        for i in plan.compute_blocks:
            self._write(plan.hashes[i], plan.block_table[i])
        for i, source in enumerate(plan.sources):
            self.tally.tokens[source] += self.w.block_size
            if source is not Tier.COMPUTE:
                self.tally.checked += 1
                self.tally.verified += self._check(plan.hashes[i], plan.block_table[i])
        self.tally.tokens[Tier.COMPUTE] += len(tokens) % self.w.block_size  # the partial tail
        self.tally.prefill_tokens += len(tokens)
        self.tally.requests += 1
        pairs = self.index.finish(request_id)
        if pairs:
            hashes, devices = zip(*pairs)
            res = self._call("save", self.client.save, list(hashes), list(devices))
            self.index.apply_save(pairs, len(res.blocks))

    def _evict(self, plan: Plan) -> None:
        """Run evictions in order, batching consecutive ones of a kind."""
        for kind, group in itertools.groupby(plan.evictions, key=type):
            batch = list(group)
            if kind is SwapOutEviction:
                swaps = [e for e in batch if isinstance(e, SwapOutEviction)]
                self._call(
                    "swap_out",
                    self.client.swap_out,
                    [e.device_block_id for e in swaps],
                    [e.host_block_id for e in swaps],
                )
                continue
            saves = [e for e in batch if isinstance(e, SaveHostEviction)]
            hashes = [e.block_hash for e in saves]
            res = self._call(
                "save_host", self.client.save_host, hashes, [e.host_block_id for e in saves]
            )
            for j, h in enumerate(hashes):
                self.index.apply_save_host(h, j < len(res.blocks))


def conversations(w: Workload):
    """Token ids of every request, turn by turn: (turn, user, tokens)."""
    rng = np.random.default_rng(w.seed)
    system = rng.integers(0, 32000, w.system_tokens).tolist()
    histories: list[list[int]] = [[] for _ in range(w.users)]
    for turn in range(w.turns):
        for user in range(w.users):
            message = rng.integers(0, 32000, w.user_tokens).tolist()
            reply = rng.integers(0, 32000, w.reply_tokens).tolist()
            histories[user] += message + reply
            yield turn, user, system + histories[user]


def run(
    w: Workload,
    storage: dict,
    ranks: int = 2,
    use_host: bool = True,
    use_storage: bool = True,
    write_policy: str = "write_through",
    progress: bool = True,
    instance_id: str | None = None,
) -> dict[str, Any]:
    """Serve the workload once; returns the tally. Leaves nothing behind."""
    spec = w.spec()
    instance = instance_id or f"demo{uuid.uuid4().hex[:8]}"
    index = CacheIndex(
        w.block_size,
        w.device_blocks,
        w.host_blocks if use_host else 0,
        write_policy,
        use_storage=use_storage,
        use_host=use_host,
    )
    start = time.perf_counter()
    with CleanupStack() as stack:
        caches = [
            stack.enter_context(DeviceCache.create(spec, cache_name(instance, r)))
            for r in range(ranks)
        ]
        client = stack.enter_context(
            Client.launch(
                spec,
                ranks,
                storage,
                instance_id=instance,
                num_host_blocks=max(1, w.host_blocks),
                staging_blocks=32,
            )
        )
        engine = Engine(w, client, caches, index)
        for turn, user, tokens in conversations(w):
            engine.serve(f"t{turn}u{user}", tokens)
            if progress and user == w.users - 1:
                t = engine.tally
                reused = 1 - t.tokens[Tier.COMPUTE] / max(1, t.prefill_tokens)
                print(
                    f"  turn {turn + 1}/{w.turns}: {t.requests} requests, "
                    f"{reused:.0%} of prefill reused, {t.verified}/{t.checked} blocks "
                    f"verified",
                    file=sys.stderr,
                    flush=True,
                )
        index.check()
    result = engine.tally.as_dict()
    result["wall_s"] = time.perf_counter() - start
    result["ranks"] = ranks
    return result
