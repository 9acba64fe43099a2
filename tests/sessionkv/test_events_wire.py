"""The event log's numbering and catch-up, and the control frames' replay guard."""

import os
import select
import threading
import time

import msgspec

from sessionkv import control as wire
from sessionkv.events import Association, EventLog, Outcome, decode, encode
from sessionkv.hints import HintOutcome, Status


def ev(i):
    return Association(session_id=f"s{i}", op="extend", tier="G1", blocks=i)


def test_sequence_numbers_grow_by_one_and_catch_up_returns_the_rest():
    log = EventLog(capacity=100)
    assert [log.append(ev(i)) for i in range(10)] == list(range(1, 11))
    events, oldest, nxt = log.since(4, 3)
    assert [e.seq for e in events] == [5, 6, 7] and (oldest, nxt) == (1, 11)
    assert log.since(10, 5) == ([], 1, 11)
    assert [e.seq for e in log.since(0, 1000)[0]] == list(range(1, 11))


def test_a_full_log_keeps_the_newest_and_reports_the_gap():
    log = EventLog(capacity=50)
    for i in range(200):
        log.append(ev(i))
    events, oldest, nxt = log.since(3, 1000)
    assert (oldest, nxt) == (151, 201)
    assert [e.seq for e in events] == list(range(151, 201))  # the gap: 4..150 are gone
    assert [e.seq for e in log.since(180, 5)[0]] == [181, 182, 183, 184, 185]


def test_wake_fd_signals_once_per_batch_and_drain_hands_each_event_once():
    log = EventLog()
    assert select.select([log.wake_fd], [], [], 0)[0] == []
    for i in range(1000):
        log.append(ev(i))
    assert select.select([log.wake_fd], [], [], 0)[0] == [log.wake_fd]
    assert len(os.read(log.wake_fd, 4096)) == 1  # one byte for the batch
    assert [e.seq for e in log.drain_new()] == list(range(1, 1001))
    assert log.drain_new() == []
    log.append(ev(0))
    assert [e.seq for e in log.drain_new()] == [1001]
    assert select.select([log.wake_fd], [], [], 0)[0] == []


def test_appends_from_threads_get_distinct_consecutive_numbers():
    log = EventLog(capacity=10_000)
    threads = [
        threading.Thread(target=lambda: [log.append(ev(i)) for i in range(1000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.seq for e in log.since(0, 10_000)[0]] == list(range(1, 4001))


def test_events_round_trip_through_msgpack_with_their_kind():
    out = Outcome(outcome=HintOutcome("h", "kv.pin", Status.CLIPPED, 4, 2, "ttl"), via="control")
    log = EventLog()
    log.append(out)
    back = decode(encode(out))
    assert back == out and back.__struct_config__.tag == "outcome"
    assert msgspec.to_builtins(back)["kind"] == "outcome"


def test_replay_guard_wants_growing_counters_near_the_clock():
    g = wire.ReplayGuard(window_s=5, max_clients=2)
    now = time.time_ns()
    assert g.check("a", now) == ""
    assert g.check("a", now) == "replayed frame"
    assert g.check("a", now - 1) == "replayed frame"
    assert g.check("a", now + 1) == ""
    assert g.check("b", now) == "" and g.check("b", now) == "replayed frame"
    assert g.check("c", now - 10 * 10**9).startswith("stale frame")
    assert g.check("c", now + 10 * 10**9).startswith("stale frame")
    # A forgotten client's old frame is still refused: it is outside the window.
    g.check("d", now)
    g.check("e", now)
    assert g.check("a", now - 6 * 10**9).startswith("stale frame")


def test_frame_macs_depend_on_secret_domain_and_payload():
    p = b"payload"
    tag = wire.mac(wire.REQUEST_DOMAIN, p, b"k" * 16)
    assert wire.authentic(wire.REQUEST_DOMAIN, p, tag, b"k" * 16)
    assert not wire.authentic(wire.REPLY_DOMAIN, p, tag, b"k" * 16)  # no reflection
    assert not wire.authentic(wire.REQUEST_DOMAIN, p + b"x", tag, b"k" * 16)
    assert not wire.authentic(wire.REQUEST_DOMAIN, p, tag, b"j" * 16)
