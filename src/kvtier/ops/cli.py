"""The `kvtier` command: demo, serve, bench.

Only this module (and ``kvtier.worker.config``) reads argv and the environment. Subcommands import
what they need when they run, so ``kvtier --help`` answers without importing torch. Every error
is one line, ``kvtier: error: <field>: <what is wrong and what is allowed>``, exit code 2;
Ctrl-C exits 130 and SIGTERM 143, both after cleaning up.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.common.bindguard import reexec_with
from kvtier.errors import ConfigError, KvtierError
from kvtier.layout.legacy_flags import legacy_flag_parser, spec_from_legacy_args
from kvtier.ops.cli_args import (
    COUNT,
    SIZE,
    WRITE_POLICIES,
    DefaultsFormatter,
    Parser,
    chosen_parser,
    integer,
    positive_number,
)
from kvtier.ops.demo_cli import add_demo
from kvtier.ops.model_cli import add_make_model
from kvtier.ops.pd_proxy_cli import add_pd_proxy
from kvtier.ops.status import add_status
from kvtier.ops.store_cli import add_store
from kvtier.ops.table import printable
from kvtier.storage import mooncake_config, process_environment, with_memory_tier

BENCHES = {  # name -> what it measures; the code is kvtier_bench.<name>
    "copy": "device<->host swap GB/s vs contiguous copy and loop",
    "storage": "storage save/load GB/s vs raw disk / raw Mooncake",
    "e2e": "the chat workload: device-only vs +host vs kvtier",
    "latency": "heartbeat, 1-block task, lookup and lookups/s vs a bare ZeroMQ echo",
    "vllm": "a real vLLM engine: recompute vs kvtier miss+save vs kvtier hits",
    "serve": "vllm serve with kvtier vs without: fair binding, 4 workloads, interleaved rounds",
    "cluster": "engines sharing a Mooncake cluster; prefill/decode through it vs one instance",
    "trace": "a Mooncake-format request trace replayed against vllm serve, kvtier vs none",
    "router": "vllm-router in front of a kvtier server: TTFT through it vs direct",
    "reuse": "vllm bench serve's prefix_repetition vs vllm serve, kvtier at its defaults vs none",
    "decide": "load or recompute replayed on the audit's sequences: hits lost vs an oracle",
    "hosted": "kvtier under LMCache, SGLang, vLLM: lmcache bench l2 vs fs; each vs storage alone",
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that every ``finally`` runs."""


# ---- demo ---------------------------------------------------------------------------------------


# ---- serve --------------------------------------------------------------------------------------


def _add_serve(sub, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="run one worker (one per tensor-parallel rank)",
        description="Run one worker. Settings come from --config YAML, then KVTIER_<FIELD> "
        "variables, then these flags (flags win). The old engine's flags are accepted too.",
    )
    serve.add_argument(
        "--config",
        help="YAML file with worker settings (see docs/operating.md); - reads it from standard "
        "input",
    )
    # Set by kvtier.engine.launcher: its YAML (on standard input) is the whole resolved config
    # (environment read); --launched-as names the instance and rank for ps and the tests.
    serve.add_argument("--config-is-complete", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument("--launched-as", help=argparse.SUPPRESS)
    serve.add_argument("--rank", type=integer(0), help="this worker's tensor-parallel rank")
    serve.add_argument(
        "--world-size", "--mp_num", dest="world_size", type=COUNT, help="tensor-parallel ranks"
    )
    serve.add_argument(
        "--instance-id", help="the engine instance: names its device caches and sockets"
    )
    serve.add_argument(
        "--num-host-blocks",
        "--num_cpu_blocks",
        dest="num_host_blocks",
        type=COUNT,
        help="blocks of the host pool",
    )
    serve.add_argument("--device-cache", help="name of the shared device cache")
    serve.add_argument(
        "--device-cache-mode",
        choices=["attach", "create"],
        help="attach to the engine's device cache, or create one (standalone tests, demos)",
    )
    _add_serve_runtime_flags(serve)
    legacy_flag_parser(serve.add_argument_group("the old engine's cache flags"), required=False)
    serve.set_defaults(func=_serve)


def _add_serve_runtime_flags(serve: argparse.ArgumentParser) -> None:
    """Where the worker runs and what it serves: device, storage, endpoint, timeouts, logs."""
    serve.add_argument("--device", help="cpu, cuda or cuda:N")
    _add_storage_flags(serve)
    serve.add_argument("--namespace", help="model id used in storage keys")
    serve.add_argument("--model-dir", "--model_path", dest="model_dir", help="holds version.yaml")
    serve.add_argument("--endpoint", help="ipc:///PATH or tcp://127.0.0.1:PORT")
    serve.add_argument(
        "--engine-timeout-s",
        type=positive_number,
        help="exit when the engine is silent this long after its first hello",
    )
    serve.add_argument(
        "--start-timeout-s", type=positive_number, help="exit when no engine said hello by then"
    )
    serve.add_argument(
        "--metrics-port", type=integer(0, 65535), help="Prometheus exporter on 127.0.0.1"
    )
    serve.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="the worker's log level"
    )
    serve.add_argument("--cpu-cores", help="run on these cores (a CPU list: 1 or 0,2-3)")
    serve.add_argument(
        "--write_policy",
        "--write-policy",
        dest="write_policy",
        help="accepted for the old engine: write_through only (write_back is the engine-side "
        "CacheIndex's policy, not a worker's)",
    )
    serve.add_argument(
        "--max_model_len",
        "--max-model-len",
        dest="max_model_len",
        type=COUNT,
        help="longest request in tokens: sizes the storage staging",
    )
    serve.add_argument(
        "--device_id",
        "--device-id",
        dest="device_id",
        type=integer(0),
        help="with --device cuda: the GPU's index (the same as --device cuda:N)",
    )


def _serve(args: argparse.Namespace) -> int:
    """One worker process: configuration from --config YAML, KVTIER_* env, then flags."""
    from kvtier.memory.device import require_device
    from kvtier.worker.config import load_config
    from kvtier.worker.loop import Worker

    environ = {} if args.config_is_complete else os.environ  # a launcher resolved it already
    config = load_config(args.config, _serve_overrides(args), environ)
    if args.memory_tier:
        storage = with_memory_tier(config.storage, args.memory_tier)
        config = dataclasses.replace(config, storage=storage)  # parsed (checked) again
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper()),
        force=True,
        format=f"%(asctime)s rank{config.rank} %(levelname)s %(name)s: %(message)s",
    )

    require_device(config.device, "device")
    mooncake = mooncake_config(config.storage_config)
    if mooncake is not None:  # the edge sets what Mooncake reads
        reexec_with(process_environment(mooncake))  # LD_PRELOAD works only from the start
    return Worker(config).serve()


def _add_storage_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--storage-backend",
        "--storage_backend",
        dest="storage_backend",
        help="file|mooncake|memory",
    )
    serve.add_argument("--storage-root", help="file backend directory")
    serve.add_argument(
        "--memory-tier",
        type=SIZE,
        metavar="SIZE",
        help="a host-memory tier of SIZE bytes (K/M/G) in front of the storage backend",
    )


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = [
        "rank",
        "world_size",
        "instance_id",
        "num_host_blocks",
        "device_cache",
        "device_cache_mode",
        "device",
        "namespace",
        "model_dir",
        "endpoint",
        "engine_timeout_s",
        "start_timeout_s",
        "metrics_port",
        "log_level",
        "cpu_cores",
    ]
    overrides: dict[str, Any] = {n: getattr(args, n) for n in names}
    if args.key_cache_shape:
        overrides["spec"] = spec_from_legacy_args(args)
    elif args.num_layers is not None or args.value_cache_shape:
        raise ConfigError("key_cache_shape", "the old cache flags need --key_cache_shape N,H,B,D")
    if args.write_policy is not None and args.write_policy != "write_through":
        allowed = ", ".join(WRITE_POLICIES)
        if args.write_policy not in WRITE_POLICIES:
            raise ConfigError("write_policy", f"got {args.write_policy!r}; allowed: {allowed}")
        raise ConfigError(
            "write_policy",
            "write_back is decided by the engine (kvtier.engine.index.CacheIndex), "
            "not by a worker: "
            "a worker saves what it is told; pass write_through or leave the flag out",
        )
    if args.max_model_len is not None:  # stage a whole request per step, as the old staging did
        if "spec" not in overrides:
            raise ConfigError("max_model_len", "needs the old cache flags (--key_cache_shape)")
        overrides["staging_blocks"] = -(-args.max_model_len // overrides["spec"].block_size)
    if args.device_id is not None:
        if not (args.device or "").startswith("cuda"):
            raise ConfigError("device_id", "applies to --device cuda only")
        overrides["device"] = f"cuda:{args.device_id}"
    storage = {"backend": args.storage_backend, "root": args.storage_root}
    if any(v is not None for v in storage.values()):  # merged into the YAML's, key by key
        overrides["storage"] = storage
    return overrides


# ---- bench --------------------------------------------------------------------------------------


def _add_bench(sub, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser(
        "bench", parents=[common], help="benchmarks, each beside the limit it is measured against"
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, text in BENCHES.items():
        # Options are parsed by the benchmark's own parser, imported only when it runs.
        b = bench_sub.add_parser(name, help=text, add_help=False, parents=[common])
        b.set_defaults(func=_bench, bench_name=name, takes_extra=True)


def _bench(args: argparse.Namespace) -> int:
    name = args.bench_name
    parser = _bench_parser(name)
    options = parser.parse_args(args.extra)  # --help and bad values answer before torch loads
    return importlib.import_module(f"kvtier_bench.{name}").report(options)


def _bench_parser(name: str) -> argparse.ArgumentParser:
    # local: the benchmarks are their own package, loaded only for `kvtier bench`
    from kvtier_bench.options import ARGUMENTS

    spec = importlib.util.find_spec(f"kvtier_bench.{name}")  # its docstring, read without importing
    doc = None
    if spec is not None and spec.origin:
        with open(spec.origin) as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    parser = Parser(
        prog=f"kvtier bench {name}",
        description=doc,
        formatter_class=DefaultsFormatter,
    )
    ARGUMENTS[name](parser)
    return parser


# ---- main ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    p = Parser(
        prog="kvtier",
        description="Move LLM KV-cache blocks between device memory, a host pool and storage.",
        parents=[common],
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands = (add_demo, _add_serve, _add_bench, add_store, add_status, add_pd_proxy)
    for add in (*commands, add_make_model):
        add(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):  # the subcommand's usage, not ours
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.command != "serve" and not args.verbose:
        # Mooncake (glog) logs routine events at ERROR ("metadata not found" on every setup):
        # quiet unless -v, before any Mooncake library loads. A worker keeps them in its log.
        os.environ.setdefault("GLOG_minloglevel", "3")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    previous = _take_interrupts()
    try:
        return _run(args.func, args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return func(args)
    except KvtierError as e:
        # Errors may quote workers' logs and stored data: never raw to the terminal.
        first, _, details = printable(str(e), keep_newlines=True).partition("\n")
        print(f"kvtier: error: {first}", file=sys.stderr)  # one line; details at -v
        if details and args.verbose:
            print(details, file=sys.stderr)
        return 2
    except Terminated:
        print("kvtier: terminated; cleaned up", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("kvtier: interrupted; cleaned up", file=sys.stderr)
        return 130


def _take_interrupts() -> dict[int, Any]:
    """SIGTERM becomes an exception in the main thread, so cleanup runs as for Ctrl-C; and
    Ctrl-C is taken even where the shell started kvtier ignoring it (a ``cmd &`` job): the
    workers kvtier starts stop on it (they share the terminal's process group), so kvtier itself
    must too, or it would find them gone and fail instead of ending with 130. Returns the
    handlers replaced.

    ``kvtier serve`` installs its own handlers (a graceful worker stop) over these.
    """

    def handler(signum, frame):
        raise Terminated()

    previous: dict[int, Any] = {}
    try:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread (tests calling main() from a thread)
        pass
    return previous


def run() -> None:
    """The console script: ``main()``, then a fast exit.

    Everything kvtier made has been released when ``main`` returns (workers stopped, shared
    memory unlinked, sockets and temporary files removed); what is left is interpreter teardown,
    which takes ~1 s with torch loaded. Ctrl-C promises about a second, so the process ends here
    once its output is flushed.
    """
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
