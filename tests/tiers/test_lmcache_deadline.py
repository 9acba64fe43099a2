"""LMCache loads read straight into G2, so a read must never land after its
deadline. A real server cannot be made to stall halfway through a reply on
cue: this fault injection uses a fake one (``StallingServer``) that sends a
reply header and half its bytes, then nothing."""

import socket
import threading
import time

import numpy as np
import pytest

from sessionkv.tiers.lmcache import REPLY, REQUEST, SUCCESS, LMCacheBackend

CHUNK = 1 << 16


class StallingServer:
    """Fault injection: answers the first GET with a full-size header and
    half the bytes, then holds the connection open without sending more."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"lm://127.0.0.1:{self.sock.getsockname()[1]}"
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        conn.recv(REQUEST.size)
        conn.sendall(REPLY.pack(SUCCESS, CHUNK, 4, 6, CHUNK, 0, 0, 0, 0))
        conn.sendall(b"\x01" * (CHUNK // 2))
        self.done.wait(10)
        conn.sendall(b"\x02" * (CHUNK // 2))       # too late: must not land
        conn.close()

    def close(self):
        self.done.set()
        self.sock.close()


def test_a_read_past_its_deadline_raises_and_writes_nothing_after():
    server = StallingServer()
    backend = LMCacheBackend(server.url)
    buf = np.zeros(CHUNK, np.uint8)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            backend.get_chunks_by(["x"], [memoryview(buf)], time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 1.0
        server.done.set()                          # the rest of the bytes arrive now
        time.sleep(0.3)
        assert (buf[:CHUNK // 2] == 1).all() and not buf[CHUNK // 2:].any()
    finally:
        server.close()
        backend.close()
