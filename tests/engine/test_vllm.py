"""kvtier as vLLM's KV connector, against the real engine (vLLM 0.32 CPU): hits come from
kvtier and greedy output is exactly that of vLLM alone.

Each scenario is one engine in its own process (``vllm_engine.py``), run once per session and
shared by the tests that check it. A tiny random Llama is built here (no downloads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import pytest

from kvtier.memory.shm import SHM_DIR

TESTS = Path(__file__).resolve().parents[1]  # the helpers live at the top of tests/
SCENARIO_TIMEOUT_S = 600


def run(scenario: str, **args) -> dict[str, dict]:
    env = dict(os.environ)
    # Two CPU workers share the two cores unpinned: pinned one per core beside another TP=2
    # server, they starved the rest of the machine for 10-25 s (TP2_ENV in the cluster test).
    if args.get("tp", 1) > 1:
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # A TMPDIR of the engine's own, removed after: vLLM's multiprocess mode leaves its ipc
    # sockets there (11 per TP=2 engine, without kvtier too), and the suite leaves nothing.
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-") as tmpdir:
        out = subprocess.run(
            [sys.executable, str(TESTS / "vllm_engine.py"), scenario, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=SCENARIO_TIMEOUT_S,
            env={**env, "TMPDIR": tmpdir},
            cwd=TESTS,
        )
    phases = {}
    for line in out.stdout.splitlines():
        if line.startswith('{"phase"'):
            record = json.loads(line)
            phases[record.pop("phase")] = record
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return phases


def _instance() -> str:
    return f"vt{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def reference(model) -> dict:
    return run("reference", model=model)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def single(model, store) -> dict:
    instance = _instance()
    phases = run(
        "single", model=model, instance=instance, storage={"backend": "file", "root": store}
    )
    # Only this engine's names: other programs use /dev/shm too.
    phases["_shm_left"] = {"names": sorted(p.name for p in SHM_DIR.iterdir() if instance in p.name)}
    return phases


def external_hits(phase: dict) -> int:
    return phase["delta"].get("external_prefix_cache_hits", 0)


def test_hits_come_from_kvtier_and_the_tokens_are_vllms(reference, single) -> None:
    ref = reference["reference"]["tokens"]
    first, hits = single["first"], single["hits"]
    assert first["tokens"] == ref
    assert single["first_saves"]["written"] > 0 and single["first_saves"]["skipped"] == 0
    # After reset_prefix_cache() every cached token comes from kvtier.
    assert hits["tokens"] == ref
    assert external_hits(hits) > 0 and all(c >= 512 for c in hits["cached"])
    assert hits["delta"]["kvtier_loaded_tokens"] == hits["delta"]["kvtier_found_tokens"] > 0
    assert hits["delta"]["kvtier_failed_tokens"] == 0


def test_loading_wrong_kv_changes_the_output(reference, single) -> None:
    """The negative control: one object's bytes under every key (valid headers, as a writer of
    the store could forge them) are loaded, and the tokens change — so equality means
    something."""
    forged = single["forged"]
    assert forged["objects"] > 0 and external_hits(forged) > 0
    assert forged["tokens"] != reference["reference"]["tokens"]


def test_corrupt_objects_are_recomputed_not_used(reference, single) -> None:
    flipped = single["flipped"]
    assert flipped["objects"] > 0
    assert flipped["tokens"] == reference["reference"]["tokens"]
    assert flipped["delta"]["kvtier_failed_tokens"] > 0
    assert flipped["delta"]["kvtier_loaded_tokens"] == 0
    assert single["worker_stats"]["corrupt"] > 0
    # Recomputed blocks were saved again: the next run hits them.
    repaired = single["after_repair"]
    assert repaired["tokens"] == reference["reference"]["tokens"] and external_hits(repaired) > 0


def test_a_new_weight_version_gets_no_hits(reference, single) -> None:
    phase = single["new_version"]
    assert phase["tokens"] == reference["reference"]["tokens"]
    assert external_hits(phase) == 0 and phase["delta"]["kvtier_found_tokens"] == 0


def test_a_router_sees_every_stored_block_and_every_retired_one_in_vllms_kv_events(
    single,
) -> None:
    """vLLM's own publisher (``--kv-events-config``, ZeroMQ) carries kvtier's tier: a
    subscriber decoding with vLLM's classes sees a BlockStored (medium STORAGE) for every object
    in the store, and a BlockRemoved for each after a weight update; hashes only, no tokens.
    When: within 1 s of the engine step after the saves (or the update) are answered — the
    saves themselves come after the requests' answers, off their path, so from an answer to
    its events is the save's time plus that (``since_answer_s``: bounded here only against a
    hang, 60 s)."""
    stored, retired = single["events_stored"], single["events_retired"]
    assert stored["want"] > 0 and stored["seen"] == stored["want"], stored
    assert stored["waited_s"] <= 1.0 and stored["token_ids"] == 0
    assert stored["since_answer_s"] <= 60.0, stored
    assert stored["ownership"] == ["kvtier:file"]
    assert retired["seen"] == retired["want"] == stored["want"], retired
    assert retired["waited_s"] <= 1.0 and retired["since_answer_s"] <= 60.0


def test_the_sleep_hooks_unmap_and_remap_the_workers_cache(reference, single) -> None:
    """vLLM 0.33's ``unregister_kv_caches`` / ``restore_kv_caches``, called twice each."""
    woken = single["woken"]
    assert (woken["asleep"], woken["awake"]) == ("sleeping", "running")
    # The segment itself: mapped by the kvtier worker before, gone from its maps while vLLM
    # sleeps (not just a state string), mapped again after the wake-up.
    assert woken["mapped"] == [True, False, True]
    assert woken["tokens"] == reference["reference"]["tokens"]
    assert external_hits(woken) > 0 and woken["delta"]["kvtier_failed_tokens"] == 0


def test_the_engine_leaves_nothing_behind(single) -> None:
    assert single["_shm_left"]["names"] == []


def test_a_fresh_engine_with_a_memory_tier_hits_the_store_then_its_memory(
    reference, single, model, store, tmp_path
) -> None:
    """A fresh engine with ``tiers: [memory, file]`` on the store the first engine filled: its
    first hits come from the file tier (and are promoted), the next ones from memory; then the
    file tier goes down and the memory tier keeps serving: no failed load, the same tokens.
    With ``load_mode: sync`` (where a memory tier pays): every load runs within its step."""
    outage = str(tmp_path / "outage")
    file = {"backend": "file", "root": store, "faults": {"unavailable_while": outage}}
    storage = {"tiers": [{"backend": "memory", "capacity_bytes": 64 << 20}, file]}
    phases = run(
        "restart",
        model=model,
        instance=_instance(),
        storage=storage,
        outage=outage,
        load_mode="sync",
    )
    restart, again = phases["restart"], phases["restart_again"]
    assert restart["tokens"] == again["tokens"] == reference["reference"]["tokens"]
    assert external_hits(restart) > 0 and external_hits(again) > 0
    for phase in (restart, again):
        loaded = phase["delta"]["kvtier_loaded_tokens"]
        assert phase["delta"]["kvtier_in_step_loaded_tokens"] == loaded > 0, phase["delta"]
    # Everything was stored: nothing is written again, and the counts say so (the connector
    # said 640 saved tokens beside 0 bytes written).
    assert phases["restart_saves"]["written"] == 0 and phases["restart_saves"]["skipped"] > 0
    assert restart["delta"].get("kvtier_save_bytes", 0) == 0
    assert phases["restart_tiers"]["backend"] == "memory+file"
    memory, file = (phases["restart_tiers"]["tiers"][level] for level in ("0", "1"))
    assert file["hits"] > 0 and memory["promotions"] == file["hits"]
    assert memory["hits"] >= file["hits"]  # the second pass: every block from memory
    # vLLM's own stats, per tier (the lookup named each block's tier): the first pass loaded
    # from the file tier, the second from memory only.
    assert restart["delta"].get("kvtier_tier_loaded_tokens[1]", 0) > 0, restart["delta"]
    assert again["delta"].get("kvtier_tier_loaded_tokens[1]", 0) == 0, again["delta"]
    assert again["delta"]["kvtier_tier_loaded_tokens[0]"] == again["delta"]["kvtier_loaded_tokens"]
    assert again["delta"]["kvtier_failed_tokens"] == 0
    down = phases["lower_down"]
    assert down["tokens"][:4] == reference["reference"]["tokens"] and len(down["tokens"]) == 6
    assert external_hits(down) > 0 and down["delta"]["kvtier_failed_tokens"] == 0
    memory_after, file_after = (phases["lower_down_tiers"]["tiers"][lv] for lv in ("0", "1"))
    assert memory_after["hits"] > memory["hits"] and file_after["unavailable"] > 0, phases[
        "lower_down_tiers"
    ]


def test_tensor_parallel_2_in_vllms_multiprocess_mode(reference, model, tmp_path, figures) -> None:
    phases = run(
        "tp",
        model=model,
        instance=_instance(),
        tp=2,
        uni=False,
        storage={"backend": "file", "root": str(tmp_path / "store")},
    )
    # 40 s alone on a quiet machine (the engine up in ~27 s); 141 s when it ran beside another
    # engine file, before those files ran one after another (tests/conftest.py).
    figures["engine_up_s"] = round(phases["first"]["at_s"] - phases["first"]["wall_s"], 1)
    figures["last_phase_at_s"] = phases["hits"]["at_s"]
    ref = reference["reference"]["tokens"][:2]
    assert phases["first"]["tokens"] == ref
    assert phases["hits"]["tokens"] == ref and external_hits(phases["hits"]) > 0
    # Per-rank objects: two ranks never share a key. Had they, the second rank would find the
    # first one's object stored and skip it: nothing is skipped, and each rank wrote its half.
    from kvtier.storage.file.admin import scan

    files = list((tmp_path / "store" / "objects").rglob("*.kvb"))
    assert len(files) == phases["first_saves"]["written"]  # both ranks' objects
    assert phases["first_saves"]["skipped"] == 0
    per_rank = Counter(o.parts.rank for o in scan(str(tmp_path / "store")) if o.parts)
    assert set(per_rank) == {0, 1} and per_rank[0] == per_rank[1] == len(files) // 2, per_rank


def test_storage_down_costs_a_recompute_never_a_hang(reference, model) -> None:
    from conftest import require_mooncake

    require_mooncake()
    phases = run("storage_down", model=model, instance=_instance())
    ref = reference["reference"]["tokens"]
    assert phases["hits"]["tokens"] == ref and external_hits(phases["hits"]) > 0
    down = phases["down"]
    assert down["tokens"] == ref and external_hits(down) == 0
    assert down["wall_s"] < 30


def test_aborting_a_request_while_its_load_is_in_flight(reference, model, tmp_path) -> None:
    """The victim's blocks stay out of the pool — no other request can be handed them — until
    its load has ended; another request meanwhile gets exactly the reference tokens."""
    storage = {"backend": "file", "root": str(tmp_path / "store"), "faults": {"latency_s": 1.0}}
    phases = run(
        "abort",
        model=model,
        instance=_instance(),
        kv_bytes=32 << 20,
        max_model_len=1024,
        storage=storage,
    )
    assert phases["other"]["held_after_abort"] >= (812 - 1) // 128  # at least the loaded blocks
    assert phases["other"]["tokens"] == reference["abort_reference"]["tokens"]
    assert phases["after"]["released"]
    assert phases["after"]["counters"]["kvtier_loaded_tokens"] > 0  # the load did land


def test_at_its_defaults_a_fast_store_beside_a_cpu_hog_is_never_declined(model, tmp_path) -> None:
    """The decision as shipped (load or recompute on, ``load_mode: auto``), a file store on
    local disk, the engine beside a CPU hog: prefix reuse and a chat's turns hit, and not one
    token is declined nor one lookup skipped (round 4's decision could switch such a store off
    on one stalled save or two slow loads, with nothing showing why)."""
    phases = run(
        "defaults",
        model=model,
        instance=_instance(),
        storage={"backend": "file", "root": str(tmp_path / "store")},
    )
    total: Counter = Counter()
    for phase in phases.values():
        total.update(phase["delta"])
    assert total["kvtier_declined_tokens"] == 0, phases
    assert total["kvtier_lookups_skipped"] == 0, phases
    for r in range(4):  # vLLM's cache was reset: every shared block came from kvtier
        assert phases[f"reuse{r}_again"]["delta"]["kvtier_loaded_tokens"] >= 512, phases
    for t in (1, 2):  # each turn loads the turn before it (its prompt and its answer's blocks)
        assert phases[f"chat{t}"]["delta"]["kvtier_loaded_tokens"] >= 512, phases


def test_a_chain_over_s3_serves_on_while_the_s3_server_is_killed(
    reference, model, short_tmp_path, tmp_path
) -> None:
    """``tiers: [memory, file, s3]`` against a real S3 server (SeaweedFS), killed mid-run and
    started again: no request fails, the completions are the reference's, and the s3 tier takes
    saves again once it is back."""
    from conftest import require_s3

    require_s3()
    phases = run(
        "s3_outage",
        model=model,
        instance=_instance(),
        root=str(tmp_path / "store"),
        s3_dir=str(short_tmp_path),
    )
    expected = reference["reference"]["tokens"]
    assert phases["first"]["tokens"] == phases["hits"]["tokens"] == expected
    assert phases["s3_objects_before"]["n"] > 0  # written through to S3
    for phase in ("hits", "s3_down", "s3_back"):
        assert external_hits(phases[phase]) > 0, phase
        assert phases[phase]["delta"]["kvtier_failed_tokens"] == 0, phase
    assert phases["s3_down"]["tokens"][:4] == expected
    assert phases["s3_back"]["tokens"][:4] == expected
    assert phases["s3_objects_after"]["n"] > phases["s3_objects_before"]["n"]  # saves resumed
