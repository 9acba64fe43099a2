"""The control channel and event stream on real vLLM (tiny model, 12-chunk G2).

The engine runs in this process, so it is idle between ``serve`` calls: no
steps run, and only the channel's thread can apply a hint. Outputs are
compared with cold references in tokens and logprobs, G1 poisoned.
"""

import asyncio
import threading
import time

import msgspec
import pytest
import zmq
from test_pin_retain import (  # noqa: F401
    SECRET,
    cold,
    engine,
    flood_then_serve,
    in_g2,
    make_engine,
    reset_g1,
    run,
)

from sessionkv import control as wire
from sessionkv.client import AsyncHintClient, ControlError, HintClient
from sessionkv.devtools.server import remove_offload_region
from sessionkv.events import KINDS


def channel(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.control


@pytest.fixture
def client(engine):
    with HintClient(channel(engine).endpoint, SECRET) as c:
        yield c


def thread_cpu_ticks(tid: int) -> int:
    """User + system clock ticks of one of this process's threads."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_out_of_band_pin_on_an_idle_engine_holds_through_a_flood(engine, client):
    llm = engine
    ref = cold(llm, "S", "T")
    run(llm, "S", session="s")
    run(llm, "T", session="t")  # both in G2; the engine is idle now
    tid = channel(llm)._thread.native_id
    idle0 = thread_cpu_ticks(tid)
    time.sleep(2.0)
    # The channel thread sleeps in poll: a busy loop would burn ~200 ticks here.
    assert thread_cpu_ticks(tid) - idle0 <= 5
    out = client.pin("s", ttl_s=300)
    assert (out.status, out.blocks_affected) == ("accepted", 6)
    flood_then_serve(llm, ref)
    # Ending the session releases its pin: the next flood may take it.
    assert client.end_session("s").status == "accepted"
    assert client.end_session("s").status == "missing"
    run(llm, "X")
    run(llm, "Y")
    assert in_g2(llm, "S") == 0


def test_events_in_order_live_and_for_a_late_subscriber(engine, client):
    llm = engine
    live: list = []
    started = threading.Event()

    def follow():
        with HintClient(channel(llm).endpoint, SECRET) as c:
            it = c.subscribe(after=None, idle_timeout_s=3.0)
            started.set()
            live.extend(it)

    t = threading.Thread(target=follow)
    t.start()
    started.wait()
    time.sleep(0.3)
    first = client.events(1 << 62, 0).next_seq
    run(llm, "L", session="scen")
    assert client.pin("scen", ttl_s=60).status == "accepted"
    assert client.retain("nobody", priority=3).status == "missing"
    assert client.end_session("scen").status == "accepted"
    t.join()
    mine = [e for e in live if e.seq >= first]
    assert [e.seq for e in mine] == list(range(first, first + len(mine)))
    kinds = [e.__struct_config__.tag for e in mine]
    assert set(kinds) <= set(KINDS)
    # The turn: the session grows, the blocks are copied G1 -> G2 and become
    # resident; then the control hints' outcomes; then the session ends.
    grow = [e for e in mine if e.__struct_config__.tag == "association" and e.op == "extend"]
    assert grow and grow[-1].session_id == "scen" and grow[-1].blocks == 6
    store = next(i for i, e in enumerate(mine) if e.__struct_config__.tag == "transfer")
    assert (mine[store].src, mine[store].dst, mine[store].ok) == ("G1", "G2", True)
    res = next(i for i, e in enumerate(mine) if e.__struct_config__.tag == "residency")
    assert (res < store, mine[res].tier, mine[res].present) == (True, "G2", True)
    assert set(mine[res].keys) <= set(mine[store].keys)  # stored, then reported copied
    outs = [e for e in mine if e.__struct_config__.tag == "outcome"]
    assert [(o.outcome.action, o.outcome.status, o.via) for o in outs] == [
        ("kv.pin", "accepted", "control"),
        ("kv.retain", "missing", "control"),
        ("end_session", "accepted", "control"),
    ]
    assert kinds.index("outcome") > max(i for i, k in enumerate(kinds) if k == "transfer")
    end = mine[-2]  # then the end_session outcome
    assert (end.__struct_config__.tag, end.session_id, end.op, end.reason) == (
        "association",
        "scen",
        "end",
        "hint",
    )
    # A subscriber that joins now catches up on exactly the same events.
    with HintClient(channel(llm).endpoint, SECRET) as late:
        replay = [e for e in late.subscribe(after=first - 1, idle_timeout_s=0.5)]
    assert [msgspec.to_builtins(e) for e in replay] == [msgspec.to_builtins(e) for e in mine]


def raw_call(endpoint, frames):
    """Send frames as they are (over a CURVE-authenticated socket); the reply
    decoded without checking its MAC."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    wire.secure_client(s, SECRET)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        assert s.poll(5000)
        payload, tag = s.recv_multipart()
        assert wire.authentic(wire.REPLY_DOMAIN, payload, tag, SECRET)
        return wire.decode_reply(payload)[0]
    finally:
        s.close()


def test_bad_frames_get_rejected_outcomes_and_the_engine_keeps_serving(engine, client):
    llm = engine
    ref = cold(llm, "H")
    ep = channel(llm).endpoint
    # Wrong secret: the engine refuses the CURVE handshake, and the client says so.
    with HintClient(ep, b"not-the-router-secret-at-all") as wrong:
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="handshake refused: not authentic"):
            wrong.pin("h")
        assert time.monotonic() - t0 < 2.5  # at once, not after its 5 s timeout

    async def refused():  # the router's client, likewise
        wrong = AsyncHintClient(ep, b"not-the-router-secret-at-all")
        try:
            await wrong.pin("h")
        finally:
            wrong.close()

    t0 = time.monotonic()
    with pytest.raises(ControlError, match="handshake refused: not authentic"):
        asyncio.run(refused())
    assert time.monotonic() - t0 < 2.5
    counter, frames = client._frames("hints", session_id="h", hints={})
    bad = raw_call(ep, [frames[0], b"\0" * 32])
    assert (bad.ok, bad.outcomes[0].status) == (False, "rejected")
    assert "unauthenticated" in bad.error
    # Replayed: the same authentic frame twice.
    counter, frames = client._frames("hello")
    assert raw_call(ep, frames).ok
    again = raw_call(ep, frames)
    assert (again.ok, again.error, again.counter) == (False, "replayed frame", counter)
    # Stale: an authentic frame from two minutes ago.
    payload = wire.request_encoder.encode(
        wire.ControlRequest(client="old", counter=time.time_ns() - 120 * 10**9, op="hello")
    )
    stale = raw_call(ep, [payload, wire.mac(wire.REQUEST_DOMAIN, payload, SECRET)])
    assert not stale.ok and stale.error.startswith("stale frame")
    # Oversized, malformed, wrong shape, unknown op: rejected outcomes.
    big = b"\x00" * (wire.MAX_FRAME_BYTES + 1)
    assert "oversized" in raw_call(ep, [big, wire.mac(wire.REQUEST_DOMAIN, big, SECRET)]).error
    junk = b"\xc1not msgpack"
    assert "malformed" in raw_call(ep, [junk, wire.mac(wire.REQUEST_DOMAIN, junk, SECRET)]).error
    assert "malformed frame" in raw_call(ep, [b"a", b"b", b"c"]).error
    r = client.call("evict_everything")
    assert (r.ok, r.outcomes[0].status) == (False, "rejected") and "unknown op" in r.error
    # Malformed hints inside an authentic frame: one outcome per action.
    outs = client.hints(
        {
            "protocol_version": "1.0",
            "message_id": "m",
            "actions": [
                {
                    "action_id": "x",
                    "action_type": "kv.evict",
                    "action_version": "1.0",
                    "payload": {},
                },
                {
                    "action_id": "y",
                    "action_type": "kv.pin",
                    "action_version": "1.0",
                    "payload": {"ttl_s": -5},
                },
            ],
        },
        session_id="h",
    )
    assert [(o.hint_id, o.status) for o in outs] == [("x", "rejected"), ("y", "rejected")]
    assert client.pin("h", ttl_s=10**9).status == "missing"  # not served yet
    # The engine still serves, exactly.
    tok, lps, _ = run(llm, "H", session="h")
    assert (tok, lps) == ref["H"]
    assert client.pin("h", ttl_s=10**9).status == "clipped"  # ttl over max_ttl_s


def test_peers_without_the_secret_reach_nothing_and_read_no_events(engine, client):
    """CURVE at the socket: a peer without the cluster secret (plain ZMQ, a
    CURVE client with other keys, or raw TCP garbage) gets no reply and no
    event, and its frames never reach the channel's thread, while a client
    with the secret is served throughout. On the old code the plain peer's
    authentic-looking frames were answered and a plain SUB read every event."""
    llm = engine
    ch = channel(llm)
    refused0 = ch.peers["refused"]
    counter, frames = client._frames("hello")
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)
        other = ctx.socket(zmq.DEALER)
        other_keys = wire.curve_keys(b"another-cluster-secret")
        other.curve_serverkey = wire.curve_keys(SECRET).server_public  # knows the engine's key
        other.curve_publickey, other.curve_secretkey = (
            other_keys.client_public,
            other_keys.client_secret,
        )
        plain_sub, good_sub = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        wire.secure_client(good_sub, SECRET)
        for sub in (plain_sub, good_sub):
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(ch.events_endpoint)
        for s in (plain, other):
            s.connect(ch.endpoint)
            s.send_multipart(frames)  # a real client's frame, captured
        import socket

        host, port = ch.endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"\xff" + b"garbage" * 1000)
            time.sleep(0.5)
        assert client.pin("nobody", ttl_s=5).status == "missing"  # served throughout
        assert client.end_session("nobody").status == "missing"  # publishes an event
        assert good_sub.poll(3000)
        assert not plain_sub.poll(200) and not plain.poll(200) and not other.poll(200)
        assert ch.peers["refused"] > refused0  # the other keys' handshake
    finally:
        ctx.destroy(linger=0)


def test_an_unencodable_event_is_dropped_and_the_channel_keeps_serving(engine, client):
    """Fault injection (no path makes such an event: identifiers are checked
    on entry): an event with a lone surrogate in its session id, appended to
    the engine's log, once killed the channel's thread for good ("no reply
    within 2000 ms" for the next hello). Now it is dropped and counted, the
    events op steps past it, and the channel keeps answering."""
    from sessionkv.events import Association, Op

    ch = channel(engine)
    log = engine.llm_engine.engine_core.engine_core.scheduler.connector.manager.event_log
    seq = log.append(Association(session_id="\ud800", op=Op.EXTEND, blocks=1))
    deadline = time.monotonic() + 5
    while ch.dropped_events == 0:  # the publisher met it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.hello()["engine_id"]
    page = client.events(seq - 1, 10)
    assert page.last_seq == seq and all(ev.seq != seq for ev in page.events)


def test_a_flooding_client_is_rate_limited_others_are_served(engine):
    llm = engine
    ref = cold(llm, "G")
    run(llm, "G", session="g")
    ep = channel(llm).endpoint

    async def scenario():
        flood = AsyncHintClient(ep, SECRET, client_id="flooder", timeout_s=30)
        calm = AsyncHintClient(ep, SECRET, client_id="calm", timeout_s=30)
        try:
            flooded = asyncio.gather(*[flood.pin("g", ttl_s=5) for _ in range(400)])
            await asyncio.sleep(0)
            calm_out = [await calm.pin("g", ttl_s=5) for _ in range(5)]
            return await flooded, calm_out
        finally:
            flood.close()
            calm.close()

    flooded, calm_out = asyncio.run(scenario())
    limited = [o for o in flooded if o.status == "rejected" and "rate limit" in o.reason]
    assert len(limited) >= 250 and len(flooded) == 400  # 100/s: a burst of at most ~100 pass
    assert [o.status for o in calm_out] == ["accepted"] * 5
    reset_g1(llm)
    tok, lps, rep = run(llm, "G", session="g")
    assert (tok, lps) == ref["G"] and rep.blocks.g2 == 6


def test_status_shows_sessions_pins_outcomes_and_evictions(engine, client):
    llm = engine
    assert llm.reset_prefix_cache(reset_connector=True)
    before = client.status()["outcomes"]
    run(llm, "S", session="st")
    out = client.pin("st", ttl_s=120)
    assert (out.status, out.blocks_affected) == ("accepted", 6)
    assert client.retain("nobody-here", priority=1).status == "missing"
    st = client.status()
    (sess,) = [s for s in st["sessions"] if s["session_id"] == "st"]
    assert sess["blocks"] == 6 and sess["per_tier"]["G2"] == 6 and sess["branches"] == 1
    (p,) = [p for p in st["pins"] if p["session_id"] == "st"]
    assert p["hint_id"] == out.hint_id and p["chunks"] == 6
    assert 100 < p["expires_in_s"][0] <= p["expires_in_s"][1] <= 120
    delta = {k: v - before.get(k, 0) for k, v in st["outcomes"].items()}
    assert {k: v for k, v in delta.items() if v} == {"kv.pin/accepted": 1, "kv.retain/missing": 1}
    assert st["evictions"][-1]["reason"] == "reset"  # the reset above
    assert client.end_session("st").status == "accepted"


# Last in this file: a second engine in this process takes vLLM's worker-side
# connector (one per process), so the first engine's G2 stores stop after it.
def test_two_engines_side_by_side_have_their_own_channels(engine, tmp_path_factory, client):
    other, other_id = make_engine(tmp_path_factory, "session")
    try:
        a, b = channel(engine), channel(other)
        assert len({a.endpoint, a.events_endpoint, b.endpoint, b.events_endpoint}) == 4
        with HintClient(b.endpoint, SECRET) as cb:
            hello = cb.hello()
            assert hello["engine_id"] == other_id
            assert (hello["dp_rank"], hello["dp_size"]) == (0, 1)  # what the router checks
            # A frame for engine a (captured, say) does not replay on engine b.
            client.hello()
            _, frames = client._frames("status")
            moved = raw_call(b.endpoint, frames)
            assert not moved.ok and "another engine" in moved.error
            assert raw_call(a.endpoint, frames).ok
            assert client.hello()["engine_id"] != other_id
            run(other, "Y", session="only-on-b")
            assert cb.pin("only-on-b", ttl_s=30).status == "accepted"
            out = client.pin("only-on-b", ttl_s=30)
            assert (out.status, out.reason) == ("missing", "unknown session")
    finally:
        other.llm_engine.engine_core.shutdown()
        remove_offload_region(other_id)
    assert channel(other) is None or channel(other)._closed
