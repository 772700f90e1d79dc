"""Peers that hold a listener's connections: a local user (uid 12345) who opens connections to
the metrics exporter or ``kvtier pd-proxy``, sends nothing (or claims a body and trickles it) and
reconnects as fast as it is cut off. Round 4 bounded connections and deadlines, so 8 such
connections (the exporter) or 256 (the proxy) held every slot: 0 of 50 scrapes and 3 of 20
completions got through. Now a newcomer displaces a waiting connection of the peer that holds
the most (``kvtier.common.http_bounds``): a well-behaved client of another account is served.

Acting as another user needs root (CI runs as root); elsewhere these skip with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

from pd_upstream import post, proxy_between_upstreams

ATTACKER = 12345


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as another user (uid 12345) needs root (CI runs as root)")


ATTACK = """
import encodings.idna, os, select, socket, sys, time
port, idle, claims = map(int, sys.argv[1:4])
os.setgroups([]); os.setgid(ATTACKER); os.setuid(ATTACKER)  # all it needs is imported
claim = b"POST /v1/completions HTTP/1.1\\r\\nContent-Length: 16000000\\r\\n\\r\\n"
heads = [b""] * idle + [claim] * claims
held = {}
def connect(head):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(head)
        held[s] = head
    except OSError:
        time.sleep(0.01)
for head in heads:
    connect(head)
print("holding", len(held), flush=True)
last_trickle = time.monotonic()
while True:
    readable, _, _ = select.select(list(held), [], [], 0.05)
    for s in readable:  # an answer (503) or a close: reconnect
        head = held.pop(s)
        s.close()
        connect(head)
    while len(held) < len(heads):
        connect(heads[len(held) - len(heads)])
    if time.monotonic() - last_trickle > 0.5:
        last_trickle = time.monotonic()
        for s, head in held.items():
            if head:
                try:
                    s.send(b" ")
                except OSError:
                    pass
""".replace("ATTACKER", str(ATTACKER))


def _attack(port: int, idle: int, claims: int = 0) -> subprocess.Popen:
    """uid 12345 (a process that drops to it once it has imported what it needs: this Python
    lives under root's 0700 home): ``idle`` connections that send nothing and ``claims`` that
    claim a 16 MB body and send a byte of it every half second, each reopened as soon as it is
    closed. Returns once they are open."""
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACK, str(port), str(idle), str(claims)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert attacker.stdout is not None
    line = attacker.stdout.readline()
    assert line.startswith("holding "), line
    return attacker


def _stop(attacker: subprocess.Popen) -> None:
    attacker.kill()
    attacker.wait()


def test_reconnecting_peers_cannot_blind_the_metrics_exporter(figures) -> None:
    _needs_root()
    from kvtier.worker.metrics import MAX_CONNECTIONS, WorkerMetrics

    metrics = WorkerMetrics(0, lambda: {"storage": {}, "queue_depths": {}, "state": "running"})
    port = metrics.serve(0)
    attacker = _attack(port, idle=2 * MAX_CONNECTIONS)
    try:
        time.sleep(1.0)  # every slot is held now, and reopened when cut
        served = 0
        for _ in range(50):
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=2) as answer:
                    served += b"kvtier_worker_state" in answer.read()
            except OSError:
                pass
            time.sleep(0.05)
        figures["scrapes_served_of_50"] = served
        assert served >= 48, f"{served} of 50 scrapes served while uid {ATTACKER} held slots"
    finally:
        _stop(attacker)
        metrics.close()


@pytest.fixture
def proxy() -> Iterator:
    with proxy_between_upstreams(max_connections=32) as (server, _, _):
        yield server


def test_idle_and_claiming_peers_cannot_block_the_pd_proxy(proxy, figures) -> None:
    """uid 12345 holds twice the proxy's connections idle and 8 more claiming 16 MB bodies it
    trickles, reconnecting each as it is cut: completions of another user still go through."""
    _needs_root()
    attacker = _attack(proxy.server_address[1], idle=2 * proxy.max_connections, claims=8)
    try:
        time.sleep(1.0)
        served = 0
        for i in range(40):
            try:
                body = json.dumps({"prompt": [i], "max_tokens": 2}).encode()
                served += post(proxy, "/v1/completions", body, timeout_s=5)[0] == 200
            except OSError:
                pass
        figures["completions_served_of_40"] = served
        assert served >= 38, f"{served} of 40 completions served while uid {ATTACKER} attacked"
        assert proxy.held.get(f"uid {ATTACKER}", 0) <= 8 * 64 * 1024  # bytes as they came
    finally:
        _stop(attacker)
