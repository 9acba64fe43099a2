"""Fetcher (KVCR's kv.fetch) against sources that cannot serve it. The
successful fetch between two real engines is in tests/e2e/test_moves.py."""

import threading
import time

import zmq

from sessionkv import control as wire
from sessionkv.devtools.server import free_port
from sessionkv.engine.fetch import Fetcher
from sessionkv.hints import Action, Bounds, HashesTarget, KvHint, Status

SECRET = b"s" * 32


def fetch_from(source: str, secret: bytes = SECRET):
    """(first outcome, final outcome) of a fetch of two blocks from ``source``."""
    done, emitted = threading.Event(), []

    def emit(o):
        emitted.append(o)
        done.set()

    def prefetch(*_):
        emitted.append("prefetch started")
        done.set()

    fetcher = Fetcher(secret, prefetch, emit, timeout_s=0.5)
    try:
        hint = KvHint(
            "h1", Action.SHARE, HashesTarget((1, 2)), Bounds(destination="self"), source=source
        )
        first = fetcher.start(hint)
        assert done.wait(10)
        return first, emitted[0]
    finally:
        fetcher.close()


def test_an_unreachable_source_gives_a_rejected_final_outcome():
    source = f"tcp://127.0.0.1:{free_port()}"
    first, final = fetch_from(source)
    assert (first.status, first.blocks_asked, first.reason) == (
        Status.DEFERRED,
        2,
        f"fetching from {source}",
    )
    assert (final.hint_id, final.action, final.status) == ("h1", "kv.share", Status.REJECTED)
    assert final.reason.startswith(f"source failed: {source}: no reply within 500 ms")


def test_a_source_that_does_not_answer_authentically_is_rejected_too():
    """A fake source (a peer holding the secret that answers garbage: no
    engine does) admits the fetcher's CURVE handshake, then answers with
    frames that are not a reply under our secret."""
    ctx = zmq.Context()
    zap = ctx.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    sock = ctx.socket(zmq.ROUTER)
    wire.secure_server(sock, SECRET)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready = dict(poller.poll(100))
            if zap in ready:
                zap.send_multipart(wire.zap_reply(zap.recv_multipart(), SECRET)[0])
            if sock in ready:
                ident, *_ = sock.recv_multipart()
                sock.send_multipart([ident, b"junk", b"not-a-mac"])
                return

    t = threading.Thread(target=answer)
    t.start()
    try:
        _, final = fetch_from(f"tcp://127.0.0.1:{port}")
        assert final.status is Status.REJECTED
        assert final.reason.endswith("reply not authentic (another secret?)")
    finally:
        t.join()
        sock.close(linger=0)
        zap.close(linger=0)
        ctx.term()
