"""Which transport an endpoint gets: ``local://`` in process, anything else ZeroMQ."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.transport.auth import CurveKeys
from kvtier.transport.base import LOCAL_SCHEME, ClientTransport, ServerTransport
from kvtier.transport.local import LocalClient, LocalServer
from kvtier.transport.zeromq import ZmqClient, ZmqServer


def server_transport(
    endpoint: str,
    curve: CurveKeys | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> ServerTransport:
    """The transport for ``endpoint``; ``curve`` authenticates peers (``tcp://``), and
    ``on_refused(address)`` hears of each peer whose handshake was refused."""
    if endpoint.startswith(LOCAL_SCHEME):
        return LocalServer(endpoint)
    return ZmqServer(endpoint, curve, on_refused)


def client_transport(endpoints: Sequence[str], curve: CurveKeys | None = None) -> ClientTransport:
    local = [e.startswith(LOCAL_SCHEME) for e in endpoints]
    if all(local):
        return LocalClient(endpoints)
    if any(local):
        raise ValueError("local:// endpoints cannot be mixed with socket endpoints")
    return ZmqClient(endpoints, curve)
