"""Fetcher (KVCR's kv.fetch) against sources that cannot serve it. The
successful fetch between two real engines is in tests/e2e/test_moves.py."""

import threading

import zmq

from sessionkv.connectors.fetch import Fetcher
from sessionkv.hints import Action, Bounds, HashesTarget, KvHint, Status
from sessionkv.devtools.server import free_port


def fetch_from(source: str, secret: bytes = b"s" * 32):
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
        hint = KvHint("h1", Action.SHARE, HashesTarget((1, 2)), Bounds(destination="self"),
                      source=source)
        first = fetcher.start(hint)
        assert done.wait(10)
        return first, emitted[0]
    finally:
        fetcher.close()


def test_an_unreachable_source_gives_a_rejected_final_outcome():
    source = f"tcp://127.0.0.1:{free_port()}"
    first, final = fetch_from(source)
    assert (first.status, first.blocks_asked, first.reason) == \
        (Status.DEFERRED, 2, f"fetching from {source}")
    assert (final.hint_id, final.action, final.status) == ("h1", "kv.share", Status.REJECTED)
    assert final.reason.startswith(f"source failed: {source}: no reply within 500 ms")


def test_a_source_that_does_not_answer_authentically_is_rejected_too():
    """A peer that answers with garbage (not a reply under our secret)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if sock.poll(5000):
            ident, *_ = sock.recv_multipart()
            sock.send_multipart([ident, b"junk", b"not-a-mac"])

    t = threading.Thread(target=answer)
    t.start()
    try:
        _, final = fetch_from(f"tcp://127.0.0.1:{port}")
        assert final.status is Status.REJECTED
        assert final.reason.endswith("reply not authentic (another secret?)")
    finally:
        t.join()
        sock.close(linger=0)
        ctx.term()
