"""Run as a script: one vLLM engine (in its own process) through one scenario; prints JSON.

``python vllm_engine.py make-model DIR`` builds the tiny random Llama the tests use (no
downloads). ``python vllm_engine.py SCENARIO ARGS_JSON`` runs a scenario and prints one JSON
object per phase: the greedy tokens, vLLM's cached-token counts and the connector's counters.
Each engine lives in its own process: vLLM keeps process-wide state that a second engine in the
same process would trip over. The engine, its counters and generation are the shared driver's
(``kvtier_bench.vllm_engine``, which ``kvtier bench vllm`` runs too); the scenarios are here.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from kvtier_bench import vllm_engine as driver  # noqa: E402  (the engine all vLLM runs use)

BLOCK = 128
PREFIX = list(range(3, 515))  # 512 shared tokens: 4 full blocks


def prompts(n: int = 4, tail: int = 100, first: int = 600) -> list[list[int]]:
    return [PREFIX + [first + 7 * i + j % 5 for j in range(tail)] for i in range(n)]


def engine(args: dict):
    """The shared driver's engine (``kvtier_bench.vllm_engine``), remembered for shutdown."""
    llm = driver.engine({"kv_bytes": 128 << 20, **args})
    _ENGINES.append(llm)
    return llm


def generate(llm, token_lists: list[list[int]], max_tokens: int = 8) -> dict:
    return driver.generate(llm, token_lists, max_tokens)


counters = driver.counters
reset = driver.reset


STARTED = time.monotonic()


def emit(phase: str, **data) -> None:
    """One phase's JSON line; ``at_s``: seconds since this script started (where a slow run's
    time went: the engine's start, or a phase)."""
    at_s = round(time.monotonic() - STARTED, 2)
    print(json.dumps({"phase": phase, "at_s": at_s, **data}), flush=True)


def kvtier_client(args: dict):
    from kvtier.engine.client import Client
    from kvtier.worker.config import endpoint_for

    endpoints = [endpoint_for(args["instance"], r) for r in range(args.get("tp", 1))]
    return Client.connect(endpoints, start_timeout_s=60)


def rewrite_objects(root: str, how: str) -> int:
    """Rewrite every stored object in place: ``forge`` puts one object's payload into all of
    them with valid headers (a writer of the store loading wrong KV); ``flip`` flips a payload
    byte (the checksum catches it). Each object keeps its own key trailer."""
    import xxhash

    from kvtier.storage.format import HEADER_BYTES, read_header

    files = sorted(Path(root, "objects").rglob("*.kvb"))
    first = files[0].read_bytes()
    donor = first[HEADER_BYTES : HEADER_BYTES + read_header(first).payload_length]
    for path in files:
        data = bytearray(path.read_bytes())
        end = HEADER_BYTES + read_header(data).payload_length
        if how == "flip":
            data[end - 1] ^= 0x01
        else:
            data[HEADER_BYTES:end] = donor
            struct.pack_into("<Q", data, 40, xxhash.xxh3_64_intdigest(donor))
            struct.pack_into("<Q", data, 56, xxhash.xxh3_64_intdigest(bytes(data[:56])))
        tmp = path.with_suffix(".rewrite")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)
    return len(files)


# ---- scenarios --------------------------------------------------------------------------------


def scenario_reference(args: dict) -> None:
    llm = engine({**args, "kvtier": False})
    emit("reference", **generate(llm, prompts()))
    emit("abort_reference", **generate(llm, [prompts(1, 300, 900)[0]], max_tokens=24))


def saves(args: dict) -> dict:
    """Blocks the kvtier workers wrote and skipped as already stored, summed over ranks: exact
    once ``reset`` returned (a request's blocks are released only when its saves are answered;
    the connector's own counters reach vLLM's metrics a step later)."""
    with kvtier_client(args) as client:
        per_rank = client.control("stats").per_rank.values()
    totals = {"written": 0, "skipped": 0}
    for result in per_rank:
        counts = result.data["tasks"].get("save", {})
        totals["written"] += counts.get("blocks_written", 0)
        totals["skipped"] += counts.get("blocks_skipped", 0)
    return totals


SUBSCRIBER = """
import json, os, sys, time
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch
parent = os.getppid()
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
while os.getppid() == parent:  # ends with the scenario, however it ends
    if not sock.poll(200):
        continue
    _topic, _seq, payload = sock.recv_multipart()
    for e in decoder.decode(payload).events:
        if getattr(e, "medium", None) == "STORAGE":
            hashes = [h.hex() if isinstance(h, bytes) else h for h in e.block_hashes]
            print(json.dumps({"kind": type(e).__name__, "hashes": hashes, "at": time.time(),
                              "token_ids": len(getattr(e, "token_ids", [])),
                              "ownership": e.ownership}), flush=True)
"""


class Subscriber:
    """A router's view, in its own process as a router is: it listens on ZeroMQ, vLLM's
    publisher (given a host, not tcp://*) connects to it, and events are decoded with vLLM's own
    classes; kvtier's are those of medium STORAGE. (A SUB socket bound in the engine's own
    process received nothing from vLLM's connecting PUB socket here, though connected.)"""

    def __init__(self) -> None:
        import queue
        import subprocess
        import threading

        self.proc = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.endpoint = f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}"
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        _SUBSCRIBERS.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def storage_events(self, until=None, timeout_s: float = 1.0) -> tuple[list, float]:
        """Events received until ``until(events)`` holds or ``timeout_s`` passed; and the
        seconds waited."""
        import queue

        events: list = []
        start = time.monotonic()
        while not (until and until(events)):
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                break
            try:
                events.append(self.events.get(timeout=left))
            except queue.Empty:
                break
        return events, time.monotonic() - start

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_SUBSCRIBERS: list[Subscriber] = []


def stored_hashes(root: str) -> set:
    """vLLM's form of the block hashes of the objects in the store (as its events carry them)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from kvtier.storage.file.admin import scan

    found = set()
    for o in scan(root):
        if o.parts is not None:
            h = maybe_convert_block_hash(BlockHash(bytes.fromhex(o.parts.block_hash)))
            found.add(h.hex() if isinstance(h, bytes) else h)  # as the subscriber prints them
    return found


def events_phase(subscriber: Subscriber, kind: str, want: set, answered_at: float) -> dict:
    """Wait up to 1 s for events of ``kind`` (BlockStored / BlockRemoved) naming ``want``:
    ``waited_s`` counts from now (the saves or the update answered, an engine step taken),
    ``since_answer_s`` from ``answered_at`` (the requests' answers: the saves' own time in it)."""

    def named(events) -> set:
        return {h for e in events if e["kind"] == kind for h in e["hashes"]}

    events, waited = subscriber.storage_events(until=lambda ev: want <= named(ev))
    return {
        "want": len(want),
        "seen": len(want & named(events)),
        "waited_s": round(waited, 3),
        "since_answer_s": round(time.monotonic() - answered_at, 3),
        "token_ids": sum(e["token_ids"] for e in events),
        "ownership": sorted({e["ownership"] for e in events}),
    }


def scenario_single(args: dict) -> None:
    subscriber = Subscriber()
    llm = engine({**args, "kv_events": subscriber.endpoint})
    emit("first", **generate(llm, prompts()))
    answered_at = time.monotonic()
    reset(llm)
    emit("first_saves", **saves(args))
    root = args["storage"]["root"]
    announced = stored_hashes(root)
    emit("events_stored", **events_phase(subscriber, "BlockStored", announced, answered_at))
    emit("hits", **generate(llm, prompts()))
    with kvtier_client(args) as client:
        assert client.control("update_weights", version="RL-STEP2").code == 200
        reset(llm)
        emit("new_version", **generate(llm, prompts()))
        answered_at = time.monotonic()
        reset(llm)  # a step after the last save's answer: its news is published
        retired = events_phase(subscriber, "BlockRemoved", announced, answered_at)
        emit("events_retired", **retired)
        # back to the unversioned keys the engine's scheduler side uses: a rollback on purpose
        assert client.control("update_weights", version="", allow_rollback=True).code == 200
    reset(llm)
    emit(
        "forged",
        objects=rewrite_objects(args["storage"]["root"], "forge"),
        **generate(llm, prompts()),
    )
    reset(llm)
    emit(
        "flipped",
        objects=rewrite_objects(args["storage"]["root"], "flip"),
        **generate(llm, prompts()),
    )
    with kvtier_client(args) as client:
        stats = client.control("stats").per_rank[0].data
    emit("worker_stats", corrupt=stats["storage"]["corrupt"])
    reset(llm)
    emit("after_repair", **generate(llm, prompts()))
    sleep_and_wake(llm, args)


def sleep_and_wake(llm, args: dict) -> None:
    """vLLM >= 0.33's sleep hooks, called as its worker calls them (0.32 never does): the
    kvtier worker unmaps the cache while vLLM sleeps, and hits again after the wake-up."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()  # this process's worker side (one-process engine)
    side = connector._worker
    worker_pid, segment = side.launch.processes[0].pid, side.name

    def mapped() -> bool:
        """Whether the kvtier worker maps the device cache's segment now (its own maps)."""
        return segment in Path(f"/proc/{worker_pid}/maps").read_text()

    mapped_before = mapped()
    for _ in range(2):  # idempotent
        connector.unregister_kv_caches()
    with kvtier_client(args) as client:
        asleep = client.control("stats").per_rank[0].data["state"]
    mapped_asleep = mapped()
    for _ in range(2):
        connector.restore_kv_caches()
    with kvtier_client(args) as client:
        awake = client.control("stats").per_rank[0].data["state"]
    reset(llm)
    generated = generate(llm, prompts())
    mapped_awake = mapped()
    emit(
        "woken",
        asleep=asleep,
        awake=awake,
        mapped=[mapped_before, mapped_asleep, mapped_awake],
        **generated,
    )


def scenario_restart(args: dict) -> None:
    """A fresh engine on a stored prefix; with a tier chain, loaded again from its memory."""
    llm = engine(args)
    emit("restart", **generate(llm, prompts()))
    reset(llm)
    emit("restart_saves", **saves(args))
    emit("restart_again", **generate(llm, prompts()))
    with kvtier_client(args) as client:
        stats = client.control("stats").per_rank[0].data
    emit("restart_tiers", tiers=stats["storage_tiers"], backend=stats["storage_backend"])
    if args.get("outage"):  # the lower tier goes down: the memory tier keeps serving
        Path(args["outage"]).touch()
        reset(llm)
        emit(
            "lower_down", **generate(llm, prompts() + prompts(2, 300, 800))
        )  # new blocks; ids < vocab 1024
        with kvtier_client(args) as client:
            stats = client.control("stats").per_rank[0].data
        emit("lower_down_tiers", tiers=stats["storage_tiers"])


def scenario_tp(args: dict) -> None:
    llm = engine(args)
    emit("first", **generate(llm, prompts(2)))
    reset(llm)
    emit("first_saves", **saves(args))
    emit("hits", **generate(llm, prompts(2)))


def scenario_storage_down(args: dict) -> None:
    from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

    with LocalMaster() as master, LocalStoreNode(master, 256 << 20):
        args = {
            **args,
            "storage": master.config(global_segment_size=0, connect_timeout_s=0.5),
        }
        llm = engine(args)
        emit("first", **generate(llm, prompts()))
        reset(llm)
        emit("hits", **generate(llm, prompts()))
        master.stop()
        reset(llm)
        emit("down", **generate(llm, prompts()))


def scenario_s3_outage(args: dict) -> None:
    """``tiers: [memory, file, s3]`` over a real S3 server that is killed mid-run and comes
    back: requests never fail, completions stay the same, and S3 takes saves again after."""
    from kvtier.storage import LocalS3Server

    directory = Path(args["s3_dir"])
    server = LocalS3Server(directory)
    server.start(bucket="kvtier-engine")
    try:
        s3 = {
            "backend": "s3",
            "endpoint": server.endpoint,
            "bucket": "kvtier-engine",
            "credentials_file": str(server.write_credentials(directory / "credentials")),
            "timeout_s": 2,
            "retries": 1,
        }
        memory = {"backend": "memory", "capacity_bytes": 64 << 20}
        storage = {"tiers": [memory, {"backend": "file", "root": args["root"]}, s3]}
        llm = engine({**args, "storage": storage})
        emit("first", **generate(llm, prompts()))
        reset(llm)
        emit("hits", **generate(llm, prompts()))
        before = len(_s3_objects(server))
        emit("s3_objects_before", n=before)
        server.kill()
        reset(llm)
        emit("s3_down", **generate(llm, prompts() + prompts(2, 300, 800)))
        server.start(bucket="kvtier-engine")  # the same data and ports
        time.sleep(1.5)  # past the chain's DOWN_S: the tier is asked again
        reset(llm)
        emit("s3_back", **generate(llm, prompts() + prompts(2, 300, 900)))  # new full blocks
        deadline = time.monotonic() + 60
        while len(_s3_objects(server)) <= before and time.monotonic() < deadline:
            time.sleep(0.2)
        emit("s3_objects_after", n=len(_s3_objects(server)))
    finally:
        close_engines()
        server.stop()


def _s3_objects(server) -> list:
    import obstore

    return [m["path"] for page in obstore.list(server.client("kvtier-engine")) for m in page]


def scenario_abort(args: dict) -> None:
    """A request whose load is in flight is aborted. Its blocks must not go back to the pool
    (where another request could get them) until the load has ended; then they do. Storage
    answers slowly here (fault injection) so that the load is still in flight at the abort."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    llm = engine(args)
    victim = [(7 * i + 3) % 1000 + 10 for i in range(812)]  # shares nothing with `other`
    other = prompts(1, 300, 900)[0]
    emit("stored", **generate(llm, [victim]))
    reset(llm)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    llm.llm_engine.add_request(
        "victim", TokensPrompt(prompt_token_ids=victim), SamplingParams(max_tokens=4, temperature=0)
    )
    llm.llm_engine.step()  # lookup (a hit), blocks allocated, the load submitted
    llm.llm_engine.abort_request(["victim"])
    llm.llm_engine.step()
    held = free_before - pool.get_num_free_blocks()
    emit("other", held_after_abort=held, **generate(llm, [other], max_tokens=24))
    deadline = time.monotonic() + 60
    while pool.get_num_free_blocks() < free_before and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.05)
    emit("after", released=pool.get_num_free_blocks() == free_before, **counters_phase(llm))


def counters_phase(llm) -> dict:
    return {"counters": counters(llm)}


def scenario_defaults(args: dict) -> None:
    """Load or recompute at its defaults (``load_mode: auto`` too) on a fast file store, beside
    a CPU hog (one busy process per core and as many again, started here): prefix reuse (a
    shared 512-token prefix, new tails each round, vLLM's cache reset between the first run
    and the second) and a three-turn chat whose turns extend the last. Each phase's counters;
    the test asserts nothing was declined or skipped and that hits were loaded."""
    import subprocess

    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        llm = engine(args)
        for r in range(4):
            batch = prompts(4, tail=100, first=530 + 40 * r)
            emit(f"reuse{r}_first", **generate(llm, batch))
            reset(llm)
            emit(f"reuse{r}_again", **generate(llm, batch))
        turn = [(17 * i + 5) % 900 + 20 for i in range(600)]
        for t in range(3):
            out = generate(llm, [turn], max_tokens=16)
            emit(f"chat{t}", **out)
            reset(llm)
            turn = turn + out["tokens"][0] + [(29 * i + t) % 900 + 20 for i in range(200)]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


SCENARIOS = {
    "defaults": scenario_defaults,
    "reference": scenario_reference,
    "single": scenario_single,
    "restart": scenario_restart,
    "tp": scenario_tp,
    "storage_down": scenario_storage_down,
    "abort": scenario_abort,
    "s3_outage": scenario_s3_outage,
}

_ENGINES: list = []


def close_engines() -> None:
    """Shut the engines down the way vLLM does (connectors' shutdown included)."""
    while _ENGINES:  # once (a scenario that must stop its engine first calls it too)
        _ENGINES.pop().llm_engine.engine_core.shutdown()
    while _SUBSCRIBERS:
        _SUBSCRIBERS.pop().close()


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        driver.make_model(sys.argv[2])  # the bench's random Llama
    else:
        scenario_args = json.loads(sys.argv[2])
        # All but ``defaults`` check kvtier's bytes, not its policy: every stored prefix is
        # loaded, whatever the decision would say of this machine's load at that moment (each
        # asserts hits it needs for bytes to compare). ``defaults`` runs the decision as shipped.
        if sys.argv[1] != "defaults":
            scenario_args.setdefault("load_or_recompute", False)
        SCENARIOS[sys.argv[1]](scenario_args)
        close_engines()
    sys.stdout.flush()
    os._exit(0)  # vLLM's teardown is slow and noisy; everything this script made is released
