"""The hint planner (``sessionkv.router.hinting.HintPlanner``): every "what to
hint and when" of the router, as data, on a clock the test moves. The app
only sends what these return (its HTTP behaviour on real engines:
tests/e2e/test_router.py)."""

import ast
from pathlib import Path

import pytest
from test_retains import Clock, chain, key

from sessionkv.events import Transfer
from sessionkv.hints import Action, KvHint, envelope, parse_envelope
from sessionkv.router.config import HintPolicy, ToolCallPolicy, WarmupPolicy
from sessionkv.router.hinting import (
    End,
    Hint,
    HintPlanner,
    Move,
    RequestHints,
    Send,
    TurnEnd,
    Warmup,
    chunk_ends_in_tool_call,
)

ROOT = Path(__file__).resolve().parents[2]


def planner(**cfg):
    clock = Clock()
    p = HintPlanner(HintPolicy(**cfg), clock)
    for w in ("a", "b"):
        p.add_engine(w, 1024, 256, 100.0)
    return p, clock


def parsed(outs):
    """(worker, session, action, target session, boundary) of every hint in the Sends."""
    got = []
    for o in outs:
        assert isinstance(o, Send), o
        for h in parse_envelope(envelope(*o.actions), o.session):
            assert isinstance(h, KvHint), h
            got.append(
                (o.worker, o.session, h.action.value, h.target.session_id, h.target.boundary)
            )
    return got


PIN = ToolCallPolicy(pin=True, expected_gap_s=60.0, pin_ttl_factor=1.5, max_pins_per_client=1)
WARM = WarmupPolicy(enabled=True, lead_s=2.0)


# ---- a turn that ends in a tool call ------------------------------------------------


def test_a_tool_call_the_response_shows_gets_a_control_pin_and_a_warmup():
    p, clock = planner(tool_call=PIN, warmup=WARM, strategy="recency")
    p.turn_started("s1", "a", chain(1, 2))
    clock.now += 3
    end = p.turn_answered("s1", "a", "k-1", None, tool_call=True)
    assert end == TurnEnd(
        gap_s=60.0,
        hints=[Hint("a", Action.PIN, "s1", 0.0, {"ttl_s": 90.0})],
        over_quota=False,
        warmup=Warmup("s1", 58.0),
    )
    # then the turn is recorded: the session is Retained up to its last full block
    assert parsed(p.turn_ended("s1")) == [("a", "s1", "retain", "s1", key(2))]


def test_a_tool_gap_the_client_announced_pins_on_the_request_not_again_after():
    p, _ = planner(tool_call=PIN, warmup=WARM)
    gap = p.tool_gap("10")
    hints = p.request_hints("s1", "k-1", gap)
    ((h,),) = [parse_envelope(envelope(*hints.actions), "s1")]
    assert not hints.over_quota and h.action is Action.PIN and h.bounds.ttl_s == 15.0
    assert p.turn_answered("s1", "a", "k-1", gap, tool_call=True) == TurnEnd(
        10.0, [], False, Warmup("s1", 8.0)
    )
    assert p.tool_gap("default") == 60.0 and p.tool_gap(None) is None
    with pytest.raises(ValueError):
        p.tool_gap("-1")


def test_a_clients_pins_are_bounded_by_its_quota_until_their_ttl_ends():
    p, clock = planner(tool_call=PIN)
    assert p.turn_answered("s1", "a", "k-1", None, True).hints
    refused = p.turn_answered("s2", "a", "k-1", None, True)
    assert refused == TurnEnd(60.0, [], over_quota=True)  # the gap is recorded all the same
    assert p.request_hints("s2", "k-1", 5.0) == RequestHints([], over_quota=True)
    assert p.turn_answered("s3", "a", "k-2", None, True).hints  # another client's quota
    clock.now += 90.5  # s1's Pin ended
    assert p.turn_answered("s2", "a", "k-1", None, True).hints == [
        Hint("a", Action.PIN, "s2", 0.0, {"ttl_s": 90.0})
    ]


def test_without_tool_call_pins_a_tool_call_only_retains():
    p, _ = planner()
    assert p.turn_answered("s1", "a", "k-1", None, True) == TurnEnd(None, [])
    assert p.request_hints("s1", "k-1", 30.0) == RequestHints([])
    assert p.turn_answered("s1", "a", "k-1", 30.0, True) == TurnEnd(30.0, [])


def test_a_streamed_chunk_shows_a_tool_call_however_it_is_spaced():
    assert chunk_ends_in_tool_call(b'data: {"finish_reason": "tool_calls"}')
    assert not chunk_ends_in_tool_call(b'data: {"finish_reason": "stop"}')


# ---- a session's end --------------------------------------------------------------


def two_workers(p, clock):
    """s1's turns go to a, then to b."""
    p.turn_started("s1", "a", chain(1, 2))
    clock.now += 1
    p.turn_ended("s1")
    clock.now += 10
    p.turn_started("s1", "b", chain(1, 2, 3))
    clock.now += 1
    p.turn_ended("s1")


def test_a_session_that_went_to_two_workers_is_ended_on_both_after_its_demote():
    p, clock = planner(on_end="demote", strategy="recency")
    two_workers(p, clock)
    clock.now += 5
    assert p.session_ending("s1", "b") == [Hint("b", Action.DEMOTE, "s1")]
    outs = p.session_ended("s1", "b")
    assert outs[:2] == [End("a", "s1"), End("b", "s1")]
    assert all(isinstance(o, Send) for o in outs[2:])


def test_free_ends_without_a_demote_and_none_ends_nowhere():
    p, clock = planner(on_end="free", strategy="recency")
    two_workers(p, clock)
    assert p.session_ending("s1", "b") == []
    assert [o for o in p.session_ended("s1", "b") if isinstance(o, End)] == [
        End("a", "s1"),
        End("b", "s1"),
    ]
    p, clock = planner(on_end="none", strategy="recency")
    two_workers(p, clock)
    assert p.session_ending("s1", "b") == []
    assert not [o for o in p.session_ended("s1", "b") if isinstance(o, End)]


def test_a_session_the_planner_never_saw_is_ended_where_its_state_says():
    p, _ = planner(on_end="demote")
    assert p.session_ending("s9", "a") == [Hint("a", Action.DEMOTE, "s9")]
    assert p.session_ended("s9", "a") == [End("a", "s9")]
    assert p.session_ending("s9", None) == [] and p.session_ended("s9") == []


# ---- a move and a drain -------------------------------------------------------------


def test_a_move_shares_then_prefetches_what_the_share_copied_then_ends_the_old():
    p, _ = planner(on_move="share_prefetch", move_wait_s=7.0)
    move = p.move("s1", "a", "b", old_healthy=True)
    assert move == Move(
        "s1",
        "a",
        "b",
        failover=False,
        share=Hint("a", Action.SHARE, "s1", 7.0, {"destination": "b"}),
        end=End("a", "s1"),
        prefetch_wait_s=7.0,
    )
    copied = Transfer(src="g2", dst="g3", keys=chain(1, 2))
    assert move.prefetch(copied) == Hint("b", Action.PREFETCH, "s1", 7.0, {"keys": chain(1, 2)})
    assert move.prefetch(None) is None  # its final outcome did not come in time
    assert move.prefetch(Transfer(src="g2", dst="g3", keys=[])) is None


def test_share_moves_no_prefetch_none_sends_nothing_and_a_failover_nothing():
    p, _ = planner(on_move="share", move_wait_s=7.0)
    move = p.move("s1", "a", "b", old_healthy=True)
    assert move.share == Hint("a", Action.SHARE, "s1", 7.0, {"destination": "b"})
    assert move.end == End("a", "s1")
    assert move.prefetch(Transfer(src="g2", dst="g3", keys=chain(1))) is None
    assert p.move("s1", "a", "b", old_healthy=False) == Move("s1", "a", "b", failover=True)
    p, _ = planner(on_move="none")
    assert p.move("s1", "a", "b", old_healthy=True) == Move("s1", "a", "b")


def test_a_drain_demotes_every_live_session_last_sent_to_the_worker():
    p, clock = planner(move_wait_s=3.0)
    p.turn_started("s1", "a", chain(1))
    p.turn_started("s2", "b", chain(2))
    p.turn_started("s3", "a", chain(3))
    assert p.drain("a") == [
        Hint("a", Action.DEMOTE, "s1", 3.0),
        Hint("a", Action.DEMOTE, "s3", 3.0),
    ]
    p.session_ended("s1")
    assert p.drain("a") == [Hint("a", Action.DEMOTE, "s3", 3.0)]


# ---- the clock and the room -----------------------------------------------------------


def test_the_planner_reads_only_the_clock_it_is_given():
    # re-ranks once per tick_s of the injected clock, however often it is asked
    p, clock = planner(strategy="recency", tick_s=30.0)
    p.turn_started("s1", "a", chain(1, 2))
    p.turn_ended("s1")
    sent = p.status()["engines"]["a"]["hints_sent"]
    for _ in range(5):
        p.tick()
    assert p.status()["engines"]["a"]["reranked"] == 0
    clock.now += 10_000  # idle long enough to fall a rank band, past tick_s
    assert parsed(p.tick()) == [("a", "s1", "retain", "s1", key(2))]
    assert p.status()["engines"]["a"]["reranked"] == 1
    assert p.status()["engines"]["a"]["hints_sent"] == sent + 1


PURE = ("hinting", "retains", "retain_queue", "routing", "shadow", "gaps", "overlap")
IO = {"aiohttp", "asyncio", "redis", "prometheus_client", "time", "socket", "zmq", "requests"}


def test_the_decisions_live_in_modules_without_io_or_a_clock_of_their_own():
    """The planner and what it imports from the router import no I/O library
    and no clock (the planner's clock is injected)."""
    seen, todo = set(), list(PURE)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse((ROOT / "router" / f"{name}.py").read_text())
        for n in ast.walk(tree):
            mods = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module or ""]
                if isinstance(n, ast.ImportFrom)
                else []
            )
            for m in mods:
                assert m.split(".")[0] not in IO, (name, m)
                if m.startswith("sessionkv.router."):
                    todo.append(m.rsplit(".", 1)[1])
    assert seen >= set(PURE) and "app" not in seen and "transport" not in seen
