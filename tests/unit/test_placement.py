"""Where a vLLM rank's kvtier worker runs (``kvtier.vllm.placement``): on the cores vLLM keeps
free of its OpenMP compute, never on them when there is a choice."""

from __future__ import annotations

from conftest import require_vllm

require_vllm()

from kvtier.common.cpus import format_cpu_list, parse_cpu_list  # noqa: E402
from kvtier.vllm.placement import bound_elsewhere, choose, omp_cores  # noqa: E402

ALL16 = frozenset(range(16))
TWO_NODES = [frozenset(range(8)), frozenset(range(8, 16))]


def test_the_reserved_core_of_this_ranks_node_is_chosen() -> None:
    # 2 cores, VLLM_CPU_NUM_OF_RESERVED_CPU=1: compute on 0, core 1 reserved.
    placed = choose(frozenset({0, 1}), frozenset({0}), frozenset(), [frozenset({0, 1})])
    assert placed.cores == {1} and placed.reserved
    # TP=2 on two NUMA nodes, auto binding (vLLM reserves the tail of each rank's list).
    rank1 = choose(ALL16, frozenset(range(8, 14)), frozenset(), TWO_NODES)
    assert rank1.cores == {14, 15} and rank1.reserved


def test_other_ranks_compute_cores_are_never_chosen() -> None:
    # Auto binding of TP=2 on one node: rank 0 computes on 0-5, rank 1 on 6-11 (vLLM keeps its
    # reserved cores out of both lists, and knows them).
    placed = choose(ALL16, frozenset(range(6)), frozenset(range(6, 12)), [ALL16])
    assert placed.cores == set(range(12, 16)) and placed.reserved


def test_an_explicit_binding_keeps_the_worker_on_this_ranks_cores() -> None:
    """VLLM_CPU_OMP_THREADS_BIND listed: vLLM reserved nothing, and the cores outside the lists
    may be another server's (a prefill and a decode instance on one host: each kvtier worker on
    the other's spinning compute core waited ~1 s for the CPU on every request)."""
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0-2|3-5"}
    placed = choose(ALL16, frozenset({0, 1, 2}), bound_elsewhere(bind), [ALL16], explicit=True)
    assert placed.cores == {0, 1, 2} and not placed.reserved
    assert "worker_cores" in placed.note
    consumer = {"VLLM_CPU_OMP_THREADS_BIND": "1"}  # the producer is bound to core 0
    placed = choose(frozenset({0, 1}), frozenset({1}), bound_elsewhere(consumer), [], True)
    assert placed.cores == {1}


def test_no_reserved_core_shares_all_and_says_how_to_reserve_one() -> None:
    # 2 cores with a connector: vLLM wants 2 reserved, so it reserves none.
    placed = choose(frozenset({0, 1}), frozenset({0, 1}), frozenset(), [frozenset({0, 1})])
    assert placed.cores == {0, 1} and not placed.reserved
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in placed.note


def test_vllms_binding_variables_are_read() -> None:
    assert omp_cores({"OMP_PLACES": "{0,1,2}"}) == {0, 1, 2}
    assert omp_cores({"GOMP_CPU_AFFINITY": "4 5"}) == {4, 5}
    assert omp_cores({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == {2, 3}
    assert omp_cores({}) == frozenset() and omp_cores({"OMP_PLACES": "cores"}) == frozenset()
    assert bound_elsewhere({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == frozenset()


def test_cpu_lists_round_trip() -> None:
    for text in ("0", "1,3", "0-3", "0-2,5,7-9"):
        assert format_cpu_list(parse_cpu_list(text)) == text
