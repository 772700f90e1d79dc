"""The options of every benchmark, apart from the benchmarks: ``kvtier bench NAME --help``
and a bad value answer at once, without importing torch (10-15 s on a busy machine)."""

from __future__ import annotations

import argparse

from kvtier.errors import ConfigError
from kvtier.ops.cli_args import COUNT, SEED, SIZE, comma_list, integer, plot_file


def usable_device(text: str) -> str:
    """``cpu``, or ``cuda`` where this torch has a CUDA device (torch is imported for that
    question only)."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: choose cpu or cuda")
    if text == "cuda":
        # local: torch (10-15 s on a busy machine) only when CUDA is asked for
        from kvtier.memory.device import require_device

        try:
            require_device(text, "--device")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.detail) from None
    return text


def copy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="cpu", type=usable_device, help="cpu, or cuda (a CUDA build of torch)"
    )
    p.add_argument("--block-sizes", default="16,64", help="tokens per block, comma-separated")
    p.add_argument(
        "--num-blocks",
        default=None,
        help="blocks per call, comma-separated (default 16,256,1024: about 4 GiB at once; "
        "--large: 16,256,2048,4096)",
    )
    p.add_argument("--large", action="store_true", help="the larger sweep (about 17 GiB)")
    p.add_argument("--layers", type=COUNT, default=8, help="layers of the test layout")
    p.add_argument("--heads", type=COUNT, default=8, help="KV heads of the test layout")
    p.add_argument("--head-dim", type=COUNT, default=128, help="head size of the test layout")
    p.add_argument("--runs", type=COUNT, default=5, help="timed runs per figure (median)")
    p.add_argument("--seed", type=SEED, default=0, help="random block ids and bytes")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--plot", type=plot_file, metavar="FILE", help="draw GB/s against N beside the limit (PNG)"
    )
    p.add_argument(
        "--storage",
        action="store_true",
        help="also time a file-store load into device blocks (a worker's load path) beside "
        "the warm file-store load of the same objects into host memory",
    )


def storage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backends",
        type=comma_list(["file", "mooncake", "memory", "s3"]),
        default="file,mooncake",
        help="comma-separated: file, mooncake, memory (a memory tier in front of a file store), s3",
    )
    p.add_argument(
        "--sizes",
        type=comma_list(["1", "8"]),
        default="1,8",
        help="object sizes in MiB: 1 and/or 8",
    )
    p.add_argument(
        "--bytes-per-run",
        type=SIZE,
        default=512 << 20,
        help="bytes per timed save/load: 512M, 1G, 4096 (N = this / object size)",
    )
    p.add_argument("--runs", type=COUNT, default=5, help="timed runs per figure (median)")
    p.add_argument("--root", default=None, help="file store directory (default: a temp dir)")
    p.add_argument(
        "--fsync", default="none", choices=["none", "data", "full"], help="the file store's fsync"
    )
    p.add_argument("--io-threads", type=COUNT, default=4, help="the file store's I/O threads")
    p.add_argument(
        "--mooncake-master",
        default=None,
        help="host:port of a running master (default: start one on loopback)",
    )
    p.add_argument("--mooncake-metadata", default=None, help="its metadata server URL")
    p.add_argument(
        "--s3-endpoint", default=None, help="an S3 server (default: SeaweedFS started on loopback)"
    )
    p.add_argument("--s3-bucket", default=None, help="its bucket (default: kvtier-bench)")
    p.add_argument("--s3-credentials", default=None, help="a 0600 credentials file for it")
    p.add_argument("--s3-concurrency", type=COUNT, default=16, help="S3 requests in flight")
    p.add_argument(
        "--mac",
        default="off",
        choices=["off", "on", "both"],
        help="authenticated objects (keyed BLAKE3 MAC): off, on, or both to see the cost",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--plot", type=plot_file, metavar="FILE", help="draw GB/s per object size beside raw (PNG)"
    )


def e2e_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=COUNT, default=2, help="worker ranks (tensor parallel)")
    p.add_argument("--users", type=COUNT, default=16, help="concurrent chat users")
    p.add_argument("--turns", type=COUNT, default=6, help="turns per user")
    p.add_argument("--device-blocks", type=COUNT, default=160, help="device cache blocks")
    p.add_argument("--host-blocks", type=integer(0), default=256, help="host pool blocks")
    p.add_argument("--seed", type=SEED, default=0, help="workload random seed")
    p.add_argument("--runs", type=COUNT, default=3, help="runs per configuration (median)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--plot", type=plot_file, metavar="FILE", help="draw where prefill tokens came from (PNG)"
    )


def latency_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks",
        type=_count_list,
        default=[1, 2, 4, 8],
        help="rank counts to measure, comma-separated (default: 1,2,4,8)",
    )
    p.add_argument("--n", type=COUNT, default=2000, help="round trips of each kind per rank count")
    p.add_argument("--window", type=COUNT, default=16, help="lookups in flight for lookups/s")
    p.add_argument(
        "--seconds", type=float, default=2.0, help="how long lookups/s is measured (default: 2)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def _count_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be integers >= 1, comma-separated (like 1,2,4), got {text!r}"
        )
    return values


def vllm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=COUNT, default=4, help="prompts per run")
    p.add_argument("--prompt-tokens", type=COUNT, default=2040, help="tokens per prompt")
    p.add_argument("--shared-tokens", type=integer(0), default=0, help="leading tokens all share")
    p.add_argument("--reps", type=COUNT, default=5, help="repetitions (medians reported)")
    p.add_argument(
        "--load-mode", default="auto", choices=["auto", "async", "sync"], help="connector"
    )
    p.add_argument("--hidden", type=COUNT, default=512, help="hidden size of the random Llama")
    p.add_argument("--model", help="a model directory (default: build a random Llama)")
    p.add_argument("--store", help="file store directory (default: a temporary one)")
    p.add_argument("--no-storage-reference", action="store_true", help="skip the storage row")
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def server_pair_arguments(p: argparse.ArgumentParser) -> None:
    """A server with kvtier against one without, on one binding (serve, trace)."""
    p.add_argument(
        "--reserved-cpus",
        type=integer(0),
        default=None,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for both servers (default: 2 above 4 cores, else 1)",
    )
    p.add_argument(
        "--kvtier-settings",
        default="{}",
        help='more kv_connector_extra_config as JSON, e.g. \'{"worker_cores": "inherit"}\'',
    )
    p.add_argument("--model", help="a model directory (default: build a random Llama)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def extra_server_arguments(p: argparse.ArgumentParser) -> None:
    """Servers a ``bench serve`` round may add beside the pair."""
    p.add_argument(
        "--ideal",
        action="store_true",
        help="a third server per round: vLLM alone, its own cache holding every working set",
    )
    p.add_argument(
        "--ideal-kv-bytes", type=SIZE, default=1 << 30, help="the --ideal server's KV cache"
    )
    p.add_argument(
        "--null-connector",
        action="store_true",
        help="one more server per round: vLLM with a connector that does nothing (what vLLM's "
        "connector machinery costs alone)",
    )
    p.add_argument(
        "--tiered",
        type=SIZE,
        metavar="SIZE",
        help="one more server per round: kvtier with a memory tier of SIZE in front of the same "
        "kind of store as the kvtier server's; its figures are also shown divided by the kvtier "
        "server's, round by round (issue 30's (e) with --mooncake-link)",
    )


def serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=COUNT, default=3, help="interleaved rounds, fresh servers")
    p.add_argument(
        "--workloads",
        default="prefix_reuse,no_reuse,multi_turn,high_concurrency",
        help="comma-separated subset",
    )
    p.add_argument("--prefixes", type=COUNT, default=12, help="(a) distinct long prefixes")
    p.add_argument("--prefix-tokens", type=COUNT, default=1800, help="(a, b) prompt tokens")
    p.add_argument("--repeats", type=COUNT, default=4, help="(a) requests per prefix")
    p.add_argument("--concurrency", type=COUNT, default=3, help="(a, b) requests in flight")
    p.add_argument("--unique-prompts", type=COUNT, default=16, help="(b) prompts")
    p.add_argument("--output-tokens", type=COUNT, default=16, help="(a, b, d) tokens generated")
    p.add_argument("--users", type=COUNT, default=9, help="(c) chat users")
    p.add_argument(
        "--chat-concurrency", type=COUNT, default=3, help="(c) turns in flight (of any users)"
    )
    p.add_argument("--turns", type=COUNT, default=3, help="(c) turns per user")
    p.add_argument("--first-turn-tokens", type=COUNT, default=1500, help="(c) first prompt")
    p.add_argument("--turn-tokens", type=COUNT, default=200, help="(c) each later message")
    p.add_argument("--answer-tokens", type=COUNT, default=64, help="(c) tokens per answer")
    p.add_argument("--hc-prefixes", type=COUNT, default=32, help="(d) distinct prefixes")
    p.add_argument("--hc-prefix-tokens", type=COUNT, default=1024, help="(d) prefix tokens")
    p.add_argument("--hc-repeats", type=COUNT, default=3, help="(d) requests per prefix")
    p.add_argument("--hc-concurrency", type=COUNT, default=16, help="(d) requests in flight")
    p.add_argument(
        "--kv-bytes", type=SIZE, default=64 << 20, help="vLLM's KV cache (its own prefix cache)"
    )
    extra_server_arguments(p)
    p.add_argument(
        "--store-faults",
        metavar="JSON",
        help="the kvtier server's store through the fault injector, e.g. "
        "'{\"transfer_latency_s\": 2}' (a slow store: see load_or_recompute)",
    )
    p.add_argument(
        "--memory-tier",
        type=SIZE,
        metavar="SIZE",
        help="a memory tier of SIZE in front of the kvtier server's (possibly faulty) store",
    )
    p.add_argument(
        "--mooncake-link",
        metavar="RATE",
        help="the kvtier server's store: a Mooncake node behind a link of RATE (tc units: "
        "1gbit), master and node in network namespaces (root only; see kvtier_bench.slow_link)",
    )
    p.add_argument(
        "--segment-bytes", type=SIZE, default=2 << 30, help="the --mooncake-link node's memory"
    )
    server_pair_arguments(p)
    p.add_argument("--plot", type=plot_file, metavar="FILE", help="the ratios as bars (PNG)")


def cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=COUNT, default=3, help="rounds, new prompts each")
    p.add_argument("--prompts", type=COUNT, default=6, help="prompts per set")
    p.add_argument("--prompt-tokens", type=COUNT, default=1800, help="tokens per prompt")
    p.add_argument("--output-tokens", type=COUNT, default=16, help="tokens generated")
    p.add_argument("--concurrency", type=COUNT, default=2, help="requests in flight")
    p.add_argument(
        "--kv-bytes", type=SIZE, default=128 << 20, help="each server's KV cache (vLLM's own)"
    )
    p.add_argument(
        "--segment-bytes", type=SIZE, default=2 << 30, help="the storage node's Mooncake segment"
    )
    p.add_argument("--raw-runs", type=COUNT, default=15, help="timed raw Mooncake gets (median)")
    p.add_argument(
        "--pd-storage",
        default="mooncake",
        choices=["mooncake", "file"],
        help="what the producer and consumer share: the cluster, or a file store (one machine)",
    )
    p.add_argument("--skip-shared", action="store_true", help="measure only P/D (part b)")
    p.add_argument(
        "--skip-pd", action="store_true", help="measure only the shared prefixes (parts a, c)"
    )
    p.add_argument(
        "--no-mac",
        action="store_true",
        help="objects with checksums only, no MAC key (kvtier's default; the MAC is the default "
        "here, as a cluster of several users should run)",
    )
    p.add_argument("--kvtier-settings", default="{}", help="more kv_connector_extra_config as JSON")
    p.add_argument("--model", help="a model directory (default: build a random Llama)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        help="a Mooncake-format trace (JSON lines, .gz or not); default: in a checkout, "
        "../shared/traces/synthetic_trace.jsonl.gz beside it (an install has none: give one)",
    )
    p.add_argument("--start", type=integer(0), default=0, help="first line of the window")
    p.add_argument("--lines", type=COUNT, default=4000, help="trace lines in the window")
    p.add_argument(
        "--every", type=COUNT, default=40, help="prefix groups (first hash id) kept: one in N"
    )
    p.add_argument(
        "--block-tokens",
        type=COUNT,
        default=128,
        help="tokens per hash id (the trace's are 512; 128 = one vLLM block here)",
    )
    p.add_argument("--max-prompt-tokens", type=COUNT, default=1024, help="a prompt's first N")
    p.add_argument("--max-output-tokens", type=COUNT, default=16, help="output lengths capped")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.2,
        help="arrival times multiplied by this (the default: ~0.7 requests/s of the kept lines)",
    )
    p.add_argument("--max-in-flight", type=COUNT, default=8, help="requests at once, at most")
    p.add_argument(
        "--capacity-blocks",
        type=integer(0),
        default=0,
        help="kvtier's store bounded to this many blocks, and the ideal LRU too (0: unbounded)",
    )
    p.add_argument("--rounds", type=COUNT, default=2, help="interleaved rounds, fresh servers")
    p.add_argument(
        "--kv-bytes", type=SIZE, default=64 << 20, help="vLLM's KV cache (its own prefix cache)"
    )
    server_pair_arguments(p)


def router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=COUNT, default=40, help="requests each way")
    p.add_argument("--prompt-tokens", type=COUNT, default=300, help="tokens per prompt")
    p.add_argument("--model", help="a model directory (default: build a random Llama)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def reuse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=COUNT, default=3, help="interleaved rounds, fresh servers")
    p.add_argument("--prefixes", type=COUNT, default=12, help="distinct prefixes")
    p.add_argument("--prefix-tokens", type=COUNT, default=1800, help="tokens per prefix")
    p.add_argument("--suffix-tokens", type=COUNT, default=64, help="each prompt's own tokens")
    p.add_argument("--repeats", type=COUNT, default=4, help="prompts per prefix")
    p.add_argument("--concurrency", type=COUNT, default=3, help="requests in flight")
    p.add_argument("--output-tokens", type=COUNT, default=16, help="tokens generated")
    p.add_argument(
        "--kv-bytes",
        type=SIZE,
        default=64 << 20,
        help="vLLM's KV cache (64M: about a third of the default prefixes)",
    )
    p.add_argument(
        "--store-faults",
        metavar="JSON",
        help="kvtier's file store through the fault injector, e.g. "
        '\'{"stall_rate": 0.03, "stall_s": 0.2}\' (loads that stall now and then)',
    )
    p.add_argument(
        "--null-connector",
        action="store_true",
        help="one more server per round: vLLM with a connector that does nothing",
    )
    p.add_argument(
        "--s3-outage",
        type=float,
        metavar="SECONDS",
        help="kvtier's store is tiers [memory, file, s3] over a local S3 server, killed SECONDS "
        "after the client starts and started again SECONDS later",
    )
    server_pair_arguments(p)


def decide_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=SEED, default=0, help="the steps' jitter and the stalls")
    p.add_argument("--json", action="store_true", help="one JSON object per scenario")


def hosted_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier_bench.hosted import arguments  # local: its options live with it (this file's size)

    arguments(p)


ARGUMENTS = {
    "hosted": hosted_arguments,
    "decide": decide_arguments,
    "reuse": reuse_arguments,
    "router": router_arguments,
    "trace": trace_arguments,
    "cluster": cluster_arguments,
    "copy": copy_arguments,
    "storage": storage_arguments,
    "e2e": e2e_arguments,
    "latency": latency_arguments,
    "vllm": vllm_arguments,
    "serve": serve_arguments,
}
