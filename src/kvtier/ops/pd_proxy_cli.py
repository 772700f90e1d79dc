"""``kvtier pd-proxy``'s options and its run in the foreground; the proxy itself is
``kvtier.ops.pd_proxy``."""

from __future__ import annotations

import ipaddress
import sys
import time
from typing import Any

from kvtier.errors import ConfigError
from kvtier.ops import pd_proxy
from kvtier.ops.cli_args import integer, positive_number
from kvtier.ops.pd_proxy import MAX_CONNECTIONS, serve


def add_pd_proxy(sub: Any, common: Any) -> None:
    """``kvtier pd-proxy``'s options."""

    p = sub.add_parser(
        "pd-proxy",
        parents=[common],
        help="one endpoint for a prefill (kv_producer) and a decode (kv_consumer) vLLM server",
        description=pd_proxy.__doc__,
    )
    p.add_argument("--producer", required=True, help="the prefill server: http://HOST:PORT")
    p.add_argument("--consumer", required=True, help="the decode server: http://HOST:PORT")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen here only (another address than loopback gets a warning: no authentication)",
    )
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="0: a free port")
    p.add_argument(
        "--timeout-s",
        type=positive_number,
        default=600.0,
        help="bound on each upstream wait (a long prompt's prefill on a busy CPU takes minutes)",
    )
    p.add_argument(
        "--max-connections",
        type=integer(1, 65536),
        default=MAX_CONNECTIONS,
        help="client connections served at once; one more is answered 503",
    )
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: Any) -> int:

    try:
        proxy = serve(
            args.producer,
            args.consumer,
            args.host,
            args.port,
            args.timeout_s,
            args.max_connections,
        )
    except ValueError as e:
        raise ConfigError("producer/consumer", str(e)) from None
    host, port = str(proxy.server_address[0]), proxy.server_address[1]
    print(
        f"kvtier pd-proxy on http://{host}:{port}: prefill {args.producer}, decode {args.consumer}",
        flush=True,
    )
    if (warning := exposure_warning(host)) is not None:
        print(warning, file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        proxy.shutdown()
        proxy.server_close()


def exposure_warning(host: str) -> str | None:
    """The warning for a proxy that listens beyond loopback (it authenticates nobody)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"kvtier pd-proxy: warning: listening on {host}, not loopback: anyone who reaches it "
        "can send completions to both servers (it has no authentication); put an "
        "authenticating proxy in front, or use --host 127.0.0.1"
    )
