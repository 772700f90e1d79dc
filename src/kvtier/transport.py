"""ZeroMQ plumbing shared by the worker and the client: per-thread inproc senders."""

from __future__ import annotations

import threading

import zmq

# The old design's hazard: pipelining past the high-water mark makes ROUTER drop replies
# silently. Both sides bound their windows far below this, and raise it deliberately.
HWM_MESSAGES = 100_000


class ThreadLocalPush:
    """One PUSH socket per thread, connected to an inproc PULL owned by a loop thread.

    ZeroMQ sockets are not thread-safe; executor threads hand frames to the socket-owning loop
    through these. ``close()`` closes every socket it made.
    """

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._context = context
        self._address = address
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[bytes]) -> None:
        sock = getattr(self._local, "socket", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    return
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(self._address)
                self._sockets.append(sock)
            self._local.socket = sock
        sock.send_multipart(frames)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in self._sockets:
                sock.close(linger=1000)
            self._sockets.clear()


def configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.LINGER, 1000)
    return sock
