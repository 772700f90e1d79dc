"""The bind guard: processes that embed Mooncake listen only on the configured host.

Mooncake's transfer engine binds its listeners to every interface (0.0.0.0 and ::) whatever
host it is given, and its TCP protocol serves reads of registered memory to any peer without
authentication. kvtier starts every process that embeds Mooncake (workers, the probe child,
``LocalMaster``, ``LocalStoreNode``) with a small preloaded library, ``kvtier/_bindguard.c``,
that turns a wildcard ``bind()`` into a bind to ``$KVTIER_BIND_HOST``: the host the storage
config names (``local_hostname``, loopback by default). ``kvtier serve`` re-executes itself
once with that environment when it was started without it.

Without a C compiler at install time the library is missing: kvtier then says once that
Mooncake's listeners bind every interface, and the deployment must isolate the network.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

HOST_ENV = "KVTIER_BIND_HOST"
_warned = False


def library() -> str | None:
    """The built shim (``kvtier/_bindguard*.so``), or None when it was not built."""
    found = sorted(Path(__file__).parents[1].glob("_bindguard*.so"))
    return str(found[0]) if found else None


def ipv4_of(host: str) -> str:
    """``host`` as an IPv4 literal (the shim's form); a name is resolved once."""
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])


def environment(host: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a process needs so that its wildcard binds go to ``host``."""
    global _warned
    base = os.environ if base is None else base
    lib = library()
    if lib is None:
        if not _warned:
            _warned = True
            log.warning(
                "kvtier._bindguard was not built (no C compiler at install): Mooncake's transfer "
                "engine listens on every interface; isolate its network or reinstall kvtier "
                "with a compiler"
            )
        return {}
    preload = [p for p in base.get("LD_PRELOAD", "").split(":") if p]
    if lib not in preload:
        preload.insert(0, lib)
    return {HOST_ENV: ipv4_of(host), "LD_PRELOAD": ":".join(preload)}


def active(host: str) -> bool:
    """Was this process started with the guard for ``host``?"""
    lib = library()
    return (
        lib is not None
        and os.environ.get(HOST_ENV) == ipv4_of(host)
        and lib in os.environ.get("LD_PRELOAD", "").split(":")
    )


def reexec_with(env: Mapping[str, str]) -> None:
    """Replace this process by itself with ``env`` added, unless it already has it."""
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})
