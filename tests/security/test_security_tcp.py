"""Attacks on ``tcp://`` endpoints: a local user who squats the port, a stranger who connects,
a flood of unauthenticated connections.

Any local user may bind a free loopback port or connect to one, so these attacks need no second
account: the attacker runs in this process (or a thread of it) and what it can do is exactly
what another uid could do over TCP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager

import pytest
import zmq

from conftest import SPECS
from kvtier.engine.client import Client
from kvtier.errors import ConfigError, PeerNotVerified
from kvtier.transport import tasks as t
from kvtier.transport.auth import write_key
from kvtier.worker.config import WorkerConfig
from kvtier.worker.loop import Worker

SPEC = SPECS["bf16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(endpoint: str, key_file) -> WorkerConfig:
    return WorkerConfig(
        spec=SPEC,
        instance_id=f"tcp{uuid.uuid4().hex[:6]}",
        endpoint=endpoint,
        auth_key_file=str(key_file),
        device_cache_mode="create",
        storage={"backend": "memory"},
        num_host_blocks=4,
        staging_blocks=1,
    )


@contextmanager
def _worker(tmp_path, key_file=None):
    """A worker on a free tcp:// port, with the secret in ``key_file`` (made if not given)."""
    if key_file is None:
        key_file = tmp_path / "secret"
        secret = write_key(key_file)
    else:
        secret = bytes.fromhex(key_file.read_text())
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    worker = Worker(_config(endpoint, key_file)).start()
    try:
        yield worker, endpoint, key_file, secret
    finally:
        worker.close()


class _Capture:
    """A squatter on the port: accepts every connection, records what the client sends for a
    moment, then hangs up (so that the client retries and sends its opening again)."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(0.2)
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.3)
                data = b""
                try:
                    while len(data) < 1 << 16:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                except TimeoutError:
                    pass
                self.received.append(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.listener.close()


def test_a_tcp_worker_needs_a_secret_and_the_secret_file_is_private(tmp_path) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(ConfigError, match="auth_key_file"):
        WorkerConfig(spec=SPEC, instance_id="tcpx", endpoint=endpoint)
    key_file = tmp_path / "secret"
    write_key(key_file)
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    os.chmod(key_file, 0o640)
    with pytest.raises(ConfigError, match="auth_key_file.*0600"):
        Client.connect([endpoint], start_timeout_s=1, auth_key_file=str(key_file))


def test_an_impostor_on_the_port_learns_no_secret_and_is_never_believed(tmp_path) -> None:
    """The client used to send the instance secret in clear in its hello to whatever listened
    on the port, and believed whatever answered: a squatter captured the secret, answered
    ``load -> ok`` for blocks it never wrote, then used the secret against the real worker."""
    key_file = tmp_path / "secret"
    secret = write_key(key_file)
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    # 1. A squatter that records what the engine sends.
    capture = _Capture(port)
    try:
        start = time.monotonic()
        with pytest.raises(PeerNotVerified, match="impostor"):
            Client.connect([endpoint], start_timeout_s=60, auth_key_file=str(key_file))
        assert time.monotonic() - start < 30  # fails on the handshakes, not the start timeout
    finally:
        capture.close()
    captured = b"".join(capture.received)
    assert captured, "the squatter saw no connection"
    assert secret not in captured and secret.hex().encode() not in captured
    # 2. A squatter that speaks kvtier's protocol and says yes to everything. (Each squatter
    # gets a port of its own: ZeroMQ releases a closed socket's port asynchronously.)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    liar = ctx.socket(zmq.ROUTER)
    liar.bind(endpoint)
    answered = threading.Event()

    def lie() -> None:
        while not answered.is_set():
            if not liar.poll(50):
                continue
            peer, payload = liar.recv_multipart()
            for message in t.decode_frame(payload):  # the client bundles what queued up
                if isinstance(message, t.Hello):
                    welcome = t.Welcome(protocol_version=t.PROTOCOL_VERSION, rank=0, world_size=1)
                    liar.send_multipart([peer, t.encode(welcome)])
                elif (task_id := getattr(message, "task_id", None)) is not None:
                    result = t.Result(task_id=task_id, status=t.Status.OK)
                    liar.send_multipart([peer, t.encode(result)])
                    answered.set()

    liar_thread = threading.Thread(target=lie, daemon=True)
    liar_thread.start()
    try:
        with pytest.raises(PeerNotVerified, match="impostor"):
            Client.connect([endpoint], start_timeout_s=60, auth_key_file=str(key_file))
        assert not answered.is_set()  # no hello, no task ever reached it
    finally:
        answered.set()
        liar_thread.join()
        liar.close(0)
    # 3. A squatter with CURVE keys of its own (it knows the protocol, not the secret).
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    public, private = zmq.curve_keypair()
    curved = ctx.socket(zmq.ROUTER)
    curved.curve_server, curved.curve_secretkey, curved.curve_publickey = True, private, public
    curved.bind(endpoint)
    try:
        with pytest.raises(PeerNotVerified, match="impostor"):
            Client.connect([endpoint], start_timeout_s=60, auth_key_file=str(key_file))
        assert not curved.poll(100)  # not one application frame arrived
    finally:
        curved.close(0)
        ctx.term()
    # 4. A whole session between the engine and the real worker, recorded on the wire and
    # replayed to the worker, authenticates to nothing and runs nothing.
    with _worker(tmp_path, key_file) as (worker, real_endpoint, _, _):
        relay = _Relay(int(real_endpoint.rsplit(":", 1)[1]))
        try:
            with Client.connect(
                [relay.endpoint], start_timeout_s=30, auth_key_file=str(key_file)
            ) as c:
                assert c.swap_out([1], [0]).status is t.Status.OK
        finally:
            relay.close()
        recorded = b"".join(relay.from_client)
        assert len(recorded) > 200  # a CURVE handshake and a task went through
        assert secret not in recorded and secret.hex().encode() not in recorded
        tasks_before = worker.counters.snapshot()["tasks"]
        peers_before = len(worker.peers)
        port = int(real_endpoint.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(1.0)
            s.sendall(recorded)
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, ConnectionError):
                pass
        assert worker.counters.snapshot()["tasks"] == tasks_before  # nothing ran again
        assert len(worker.peers) == peers_before  # no new hello accepted


class _Relay:
    """A TCP relay that records what the client sends (a wiretap on the loopback)."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = port
        self.from_client: list[bytes] = []
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self.target))
        self._sockets += [conn, upstream]
        for src, dst, record in ((conn, upstream, True), (upstream, conn, False)):
            thread = threading.Thread(target=self._pump, args=(src, dst, record), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.from_client.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for thread in self._threads:
            thread.join(5)
        for sock in self._sockets:
            sock.close()


def test_strangers_get_no_frame_through_and_are_logged_once(tmp_path, caplog) -> None:
    """A peer without the secret used to have its messages decoded and answered ("say hello
    first"); now the handshake refuses it before any frame, and a peer that retries in a loop
    is logged once per interval, with a count."""
    caplog.set_level(logging.WARNING, logger="kvtier.worker.loop")
    with _worker(tmp_path) as (worker, endpoint, key_file, _):
        ctx = zmq.Context()
        strangers = []
        for i in range(20):
            sock = ctx.socket(zmq.DEALER)
            if i % 2:  # half speak CURVE with keys of their own, half plain ZMTP
                public, private = zmq.curve_keypair()
                sock.curve_serverkey = zmq.curve_public(b"0" * 40)
                sock.curve_publickey, sock.curve_secretkey = public, private
            sock.connect(endpoint)
            for message in (t.Hello(protocol_version=t.PROTOCOL_VERSION), t.Shutdown(task_id=9)):
                with contextlib.suppress(zmq.Again):  # dropped once its handshake failed
                    sock.send(t.encode(message), zmq.NOBLOCK)
            strangers.append(sock)
        # The same CURVE server key as the real worker, a wrong client key: refused by ZAP.
        wrong_client = ctx.socket(zmq.DEALER)
        public, private = zmq.curve_keypair()
        wrong_client.curve_serverkey = _server_key(key_file)
        wrong_client.curve_publickey, wrong_client.curve_secretkey = public, private
        wrong_client.connect(endpoint)
        with contextlib.suppress(zmq.Again):
            wrong_client.send(t.encode(t.Shutdown(task_id=10)), zmq.NOBLOCK)
        strangers.append(wrong_client)
        deadline = time.monotonic() + 10
        while worker.counters.snapshot()["errors"].get("unauthenticated", 0) < 1:
            assert time.monotonic() < deadline, "the refused handshake was never counted"
            time.sleep(0.05)
        time.sleep(0.5)
        assert not any(s.poll(0) for s in strangers)  # no answer of any kind
        for sock in strangers:
            sock.close(0)
        ctx.term()
        assert len(worker.peers) == 0
        with Client.connect([endpoint], start_timeout_s=30, auth_key_file=str(key_file)) as c:
            assert c.swap_out([1], [0]).status is t.Status.OK  # still serving, not shut down
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, [r.getMessage() for r in refusals]


def _server_key(key_file) -> bytes:
    from kvtier.transport.auth import CurveKeys

    return CurveKeys.from_file(key_file).server_public


# ---- a flood ------------------------------------------------------------------------------------

GREETING_CURVE = (
    b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31)
)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _flood(port: int, stop: threading.Event, huge: bytes) -> None:
    """Unauthenticated connections that announce and send a 60 MiB message, again and again:
    half in raw ZMTP (a CURVE greeting, then a 60 MiB frame), half as plain ZeroMQ peers."""
    ctx = zmq.Context()
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(GREETING_CURVE + b"\x06" + len(huge).to_bytes(8, "big"))
                s.sendall(huge)
        except OSError:
            pass
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        with contextlib.suppress(zmq.Again):  # no connection (its handshake failed): dropped
            sock.send(huge, zmq.NOBLOCK, copy=False)
        time.sleep(0.2)
        sock.close(0)
    ctx.term()


def test_a_flood_of_strangers_costs_the_worker_no_memory_and_no_answers(tmp_path) -> None:
    """8 connections sending 60 MiB messages without the secret used to raise the worker's RSS
    to 1.4 GiB and make the engine declare it lost in ~12 s (messages were decoded before the
    hello was checked)."""
    from kvtier.memory.device import DeviceCache, cache_name

    key_file = tmp_path / "secret"
    write_key(key_file)
    port = _free_port()
    instance = f"fl{uuid.uuid4().hex[:8]}"
    spec = SPECS["bf16"]
    cache = DeviceCache.create(spec, cache_name(instance, 0))
    client = Client.launch(
        spec,
        1,
        {"backend": "memory"},
        instance_id=instance,
        log_dir=tmp_path,
        endpoint=f"tcp://127.0.0.1:{port}",
        auth_key_file=str(key_file),
        num_host_blocks=4,
        staging_blocks=1,
        client_options={"worker_timeout_s": 10.0, "heartbeat_interval_s": 0.2},
    )
    stop = threading.Event()
    huge = os.urandom(60 << 20)
    try:
        pid = client.pids[0]
        client.swap_out([1], [0])
        before = _rss_bytes(pid)
        threads = [threading.Thread(target=_flood, args=(port, stop, huge)) for _ in range(8)]
        for thread in threads:
            thread.start()
        peak, pings = before, []
        end = time.monotonic() + 6
        while time.monotonic() < end:
            pings.append(client.ping(timeout_s=5))
            peak = max(peak, _rss_bytes(pid))
            time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a flooding thread did not stop"
        assert client.swap_out([2], [1]).status is t.Status.OK  # alive, answering, not lost
        assert peak - before <= 64 << 20, f"RSS rose by {(peak - before) >> 20} MiB"
        print(f"flood: RSS +{(peak - before) >> 20} MiB, slowest ping {max(pings):.3f} s")
        assert max(pings) < 3.0, f"a heartbeat took {max(pings):.2f} s during the flood"
    finally:
        stop.set()
        client.close()
        cache.close()
