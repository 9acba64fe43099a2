"""The router's Retain ranking (``sessionkv.router.retains``), its shadow
caches and its gap model, on a clock the test moves. The replay runs the
same classes, through the planner, against the real executor (tests/bench)."""

import ast
from pathlib import Path

import pytest

from sessionkv.hints import KvHint, envelope, parse_envelope
from sessionkv.router.config import HintPolicy
from sessionkv.router.gaps import GapModel, density_priority
from sessionkv.router.hinting import HintPlanner
from sessionkv.router.retain_queue import RERANK_STEPS, ROUTER_OWNER, End, Send
from sessionkv.router.retains import HEAD_BOOST, SessionHints
from sessionkv.router.shadow import Selector, ShadowCache

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2 + b"\0" * 4


def chain(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def policy(**cfg):
    clock = Clock()
    p = SessionHints(HintPolicy(**cfg), clock)
    p.add_engine("a", 1024, 256, 100.0)
    return p, clock


def retains(outs):
    """(envelope session, parsed hint) of every Retain in ``outs``."""
    got = []
    for o in outs:
        if isinstance(o, Send):
            for h in parse_envelope(envelope(*o.actions), o.session):
                assert isinstance(h, KvHint), h
                got.append((o.worker, o.session, h))
    return got


def test_a_continuing_session_is_retained_up_to_its_last_full_block():
    p, clock = policy(strategy="recency")
    assert retains(p.turn_started("s1", "a", chain(1, 2, 3))) == []
    clock.now += 2
    ((w, sess, h),) = retains(p.turn_ended("s1"))
    assert (w, sess, h.action.value, h.target.session_id, h.target.boundary) == (
        "a",
        "s1",
        "retain",
        "s1",
        key(3),
    )
    assert h.bounds.priority > 0 and h.bounds.ttl_s is None  # until the session ends


def test_a_retry_from_an_earlier_turn_releases_the_chain_it_left():
    """A session that goes back (a retry, an edited turn: its new chain does
    not extend the old one) first sends a Retain at 0 up to the old chain's
    end, so that chain does not stay held until the session ends; a turn
    that extends its chain sends nothing at its start."""
    p, clock = policy(strategy="recency")
    p.turn_started("s1", "a", chain(1, 2, 3))
    clock.now += 2
    p.turn_ended("s1")
    assert retains(p.turn_started("s1", "a", chain(1, 2, 3, 4))) == []  # extends it
    clock.now += 2
    p.turn_ended("s1")
    ((_, _, h),) = retains(p.turn_started("s1", "a", [key(1), key(2), key(9)]))
    assert (h.target.boundary, h.bounds.priority) == (key(4), 0)
    clock.now += 2
    ((_, _, h),) = retains(p.turn_ended("s1"))
    assert h.target.boundary == key(9) and h.bounds.priority > 0


def test_a_retain_is_re_sent_only_when_its_priority_changes():
    p, clock = policy(strategy="recency", tick_s=1.0, prior_gap_s=10.0)
    p.turn_started("s1", "a", chain(1, 2))
    (first,) = retains(p.turn_ended("s1"))
    sent = [first[2].bounds.priority]
    for _ in range(60):  # a minute idle, a tick a second
        clock.now += 1.01
        sent += [h.bounds.priority for *_, h in retains(p.tick())]
    # four steps per doubling of (median + idle): 10 s -> 70 s is about 11 steps
    assert 5 <= len(sent) - 1 <= 14, sent
    assert all(a > b for a, b in zip(sent, sent[1:])), sent  # each re-send a new, lower rank
    assert p.status()["engines"]["a"]["reranked"] == len(sent) - 1


def test_idle_retains_move_by_bands_until_g2_evicts_retained_blocks():
    """With shadows (``auto``), an idle session's Retain is re-sent once its
    priority moved ``RERANK_STEPS`` while every session fits; once the
    followed strategy's shadow evicts retained blocks, step by step for
    ``PRESSURE_TICKS`` ticks (G2 then chooses among idle sessions, and
    their order matters)."""
    p, clock = policy(tick_s=1.0, prior_gap_s=10.0)

    def idle(seconds, sid):
        sent = []
        for _ in range(seconds):
            clock.now += 1.01
            sent += [h.bounds.priority for _, s, h in retains(p.tick()) if s == sid]
        return sent

    def served(sid, keys):
        p.turn_started(sid, "a", keys)
        return [h.bounds.priority for _, s, h in retains(p.turn_ended(sid)) if s == sid]

    sent = served("s1", chain(1, 2)) + idle(600, "s1")
    # ten minutes: 10 s -> 616 s is about 24 steps, re-sent after 8 and 16 (and 24)
    assert 2 <= len(sent) - 1 <= 3, sent
    assert all(a - b >= RERANK_STEPS for a, b in zip(sent, sent[1:])), sent
    for i in range(80):  # 2,560 blocks retained: G2 holds 1,024
        served(f"t{i}", chain(*range(1000 + 100 * i, 1032 + 100 * i)))
    sent = served("s2", chain(3, 4)) + idle(60, "s2")
    steps = [a - b for a, b in zip(sent, sent[1:])]
    # step by step for PRESSURE_TICKS ticks after the last retained eviction,
    # then, with no turn evicting anything, by bands again
    assert steps[:3] == [1, 1, 1] and steps[-1] >= RERANK_STEPS, sent


def test_a_shared_prefix_is_retained_by_the_router_for_its_watch():
    p, clock = policy(strategy="recency+shared", watch_s=300.0)
    p.turn_started("s1", "a", chain(1, 2, 3))
    p.turn_ended("s1")
    clock.now += 1
    outs = p.turn_started("s2", "a", [key(1), key(2), key(9)])  # shares blocks 1 and 2
    ((_, sess, h),) = retains(outs)
    assert sess == ROUTER_OWNER and set(h.target.keys) == {key(1), key(2)}
    assert h.bounds.ttl_s == 300.0
    # s2's own Retain comes before the router's re-claim of the shared head
    order = [(s, x.target.__struct_config__.tag) for _, s, x in retains(p.turn_ended("s2"))]
    assert order == [("s2", "session"), (ROUTER_OWNER, "keys")]


def test_an_ended_session_is_ended_wherever_it_went_and_its_head_watched():
    p, clock = policy(strategy="recency+shared")
    p.add_engine("b", 1024, 256, 100.0)
    p.turn_started("s1", "a", chain(*range(1, 9)))
    p.turn_ended("s1")
    p.turn_started("s1", "b", chain(*range(1, 10)))  # moved
    outs = p.session_ended("s1")
    assert [o for o in outs if isinstance(o, End)] == [End("a", "s1"), End("b", "s1")]
    ((w, sess, h),) = retains(outs)
    assert (w, sess) == ("b", ROUTER_OWNER) and list(h.target.keys) == chain(
        1, 2, 3
    )  # first quarter
    assert p.session_ended("s1") == [] and p.turn_ended("nobody") == []


def test_hints_leave_at_the_engines_rate_and_the_queue_holds_one_per_session():
    p, clock = policy(strategy="recency")
    p._engines.clear()
    p.add_engine("a", 1024, 0, 10.0)  # 8 hints/s for the policy
    sent = 0
    for i in range(50):
        p.turn_started(f"s{i}", "a", chain(1000 + i))
        sent += len(retains(p.turn_ended(f"s{i}")))
    assert sent == 8 and p.status()["engines"]["a"]["queued"] == 42
    for i in range(50):  # new turns replace queued entries
        p.turn_started(f"s{i}", "a", chain(1000 + i, 2000 + i))
        p.turn_ended(f"s{i}")
    # at most two per session: its Retain and its first turn's prefix above it
    assert p.status()["engines"]["a"]["queued"] <= 100
    clock.now += 10
    assert len(retains(p.tick())) == 8  # the bucket holds one second


def test_live_sessions_and_seen_blocks_are_bounded():
    p, clock = policy(strategy="recency", max_sessions=10, max_blocks=50)
    for i in range(100):
        p.turn_started(f"s{i}", "a", chain(*range(100 * i, 100 * i + 5)))
        p.turn_ended(f"s{i}")
    assert p.status()["live_sessions"] == 10 and len(p._first) == 50
    for i in range(100):  # 100 sessions through 100 new shared prefixes
        p.turn_started(f"a{i}", "a", chain(50_000 + i, 60_000 + i))
        p.turn_started(f"b{i}", "a", chain(50_000 + i, 70_000 + i))
        p.session_ended(f"a{i}")
    assert len(p._shared) <= 50 and len(p._heads) <= 50


def test_without_shared_the_router_holds_nothing_itself():
    p, clock = policy(strategy="recency")
    p.turn_started("s1", "a", chain(1, 2, 3))
    p.turn_ended("s1")
    outs = p.turn_started("s2", "a", [key(1), key(2), key(9)]) + p.session_ended("s1")
    assert retains(outs) == [] and End("a", "s1") in outs


def test_plain_sends_no_session_retains():
    p, _ = policy(strategy="plain")
    p.turn_started("s1", "a", chain(1, 2))
    assert retains(p.turn_ended("s1")) == []
    assert p.session_ended("s1") == [End("a", "s1")]


def test_auto_follows_the_strategy_whose_shadow_hits_more():
    # A loop of 40 continuing sessions of 40 blocks each through a 1024-block
    # G2 (no G1), with one-block scans between turns: keeping live sessions
    # (recency) hits every return; plain LRU loses them all to the scans.
    p, clock = policy(strategy="auto")
    p._engines.clear()
    p.add_engine("a", 1024, 0, 1e6)
    for rnd in range(6):
        for s in range(20):
            clock.now += 1
            p.turn_started(f"s{s}", "a", chain(*range(10_000 * s, 10_000 * s + 40 + rnd)))
            p.turn_ended(f"s{s}")
            for j in range(40):  # one-off requests
                p.turn_started(
                    f"x{rnd}-{s}-{j}", "a", chain(5_000_000 + 1000 * (rnd * 800 + s * 40 + j))
                )
                p.session_ended(f"x{rnd}-{s}-{j}")
    st = p.status()["engines"]["a"]
    assert (
        st["strategy"] != "plain" and st["scores"]["plain"] < 0.5 * st["scores"][st["strategy"]]
    ), st


def test_shadow_evicts_plain_then_low_priorities_and_never_the_request_itself():
    sh = ShadowCache(4)
    sh.request(chain(1, 2))
    sh.set(chain(1, 2), 5, "s1")
    sh.request(chain(3))
    sh.set(chain(3), 1, "s2")
    sh.request(chain(4))  # plain
    sh.request(chain(7, 8))  # 4 goes (plain), then 3 (priority 1)
    assert sh.request(chain(1, 2)) == 2 and sh.request(chain(3)) == 0
    assert sh.request(chain(*range(20, 30))) == 0 and len(sh) == 10  # larger than G2: kept whole


def test_shadow_counts_the_evictions_of_session_retains_only():
    """Pressure for re-ranking: blocks a session Retained and G2 evicted;
    plain blocks and the router's own watches (meant to go first) do not count."""
    sh = ShadowCache(2, exempt_owner=ROUTER_OWNER)
    sh.request(chain(1))
    sh.set(chain(1), 5, ROUTER_OWNER)
    sh.request(chain(2))
    sh.set(chain(2), 5, "s1")
    sh.request(chain(3))  # 1 goes: the router's watch
    sh.request(chain(4))  # 3 goes: plain
    assert chain(1)[0] not in sh and chain(3)[0] not in sh and sh.retained_evictions == 0
    sh.set(chain(4), 5, "s2")
    sh.request(chain(5))  # 2 goes: s1's, the older Retained one
    assert chain(2)[0] not in sh and sh.retained_evictions == 1


def test_shadow_retains_keep_recency_and_the_last_owner_releases():
    """As SessionCachePolicy: a Retain changes a block's priority, not its
    recency; a session's end releases only what it retained last."""
    sh = ShadowCache(2)
    sh.request(chain(1))
    sh.request(chain(2))
    sh.set(chain(2), 4, "a")
    sh.set(chain(1), 4, "a")  # 1 stays the older of the two
    sh.request(chain(3))  # so 1 goes
    assert sh.request(chain(2)) == 1 and sh.request(chain(1)) == 0
    sh = ShadowCache(3)
    sh.request(chain(1))
    sh.request(chain(2))
    sh.set(chain(2), 4, "a")
    sh.set(chain(1), 4, "a")  # 1 stays the older of the two
    sh.set(chain(1), 4, "b")  # retained again, by b
    sh.release(chain(1, 2), "a")  # 2 is plain again, 1 stays b's
    sh.request(chain(3))
    sh.request(chain(9))  # 2 goes (plain, oldest)
    assert sh.request(chain(2)) == 0
    sh.request(chain(5))
    sh.request(chain(6))  # plain ones go before b's 1
    assert sh.request(chain(1)) == 1


def test_shadow_counts_hits_only_among_the_counted_keys():
    sh = ShadowCache(8)
    sh.request(chain(1, 2, 3), counted=2)  # 3: a partial block the engine stores too
    assert sh.request(chain(1, 2, 3), counted=2) == 2 and len(sh) == 3


def test_shadow_g1_serves_what_g2_dropped():
    sh = ShadowCache(2, g1_blocks=2)
    sh.request(chain(1, 2))
    sh.request(chain(3, 4))  # G2 and G1 now hold 3, 4
    assert sh.request(chain(3, 4)) == 2 and sh.request(chain(1)) == 0


def test_shadow_samples_big_engines_and_scales_hits_back():
    sh = ShadowCache(1_000_000, max_blocks=1000)
    assert sh.rate == pytest.approx(0.001) and sh.capacity == 1000
    keys = [i.to_bytes(8, "big") for i in range(100_000)]  # small ids, as the replay's
    kept = sh.keys_of(keys)
    assert 50 <= len(kept) <= 150
    sh.request(kept)
    assert sh.request(kept) == pytest.approx(len(kept) * 1000)


def test_selector_switches_only_past_its_margin():
    sel = Selector(["a", "b"], half_life_refs=100, margin=0.1)
    assert not sel.record(10, {"a": 10, "b": 10.5}) and sel.current == "a"
    assert sel.record(10, {"a": 0, "b": 20}) and sel.current == "b" and sel.switches == 1


def test_selector_follows_a_small_lead_only_when_it_is_consistent():
    # b leads by 1 % on every request: far inside the 10 % margin, but no
    # noise makes it, so the selector follows it within a few requests.
    sel = Selector(["a", "b"], half_life_refs=10_000, margin=0.1)
    switched = [sel.record(10, {"a": 100.0, "b": 101.0}) for _ in range(10)]
    assert sel.current == "b" and switched.index(True) >= 3 and sel.switches == 1
    # The same 1 % mean lead as noise (b far ahead, then far behind) is not
    # followed: its lead stays within two standard errors.
    sel = Selector(["a", "b"], half_life_refs=10_000, margin=0.1)
    for i in range(2_000):
        sel.record(10, {"a": 100.0, "b": 150.0 if i % 2 else 52.0})
    assert sel.current == "a" and sel.switches == 0


def test_gap_model_density_is_returns_per_second_held():
    # Every gap is 100 s: a session that has just finished is reused once per
    # ~100 s held; one idle for 50 s once per ~50 s; one idle past every gap
    # seen is never expected back.
    g = GapModel(prior_weight=0.0)
    for _ in range(50):
        g.add(100.0)
    g.refresh()
    assert g.density(0.0) == pytest.approx(1 / 100, rel=0.1)
    assert g.density(50.0) == pytest.approx(1 / 50, rel=0.15)
    assert g.density(500.0) == 0.0
    # Half never come back: half the hits for the same holding time, or less.
    g.add_never()
    for _ in range(49):
        g.add_never()
    g.refresh()
    assert g.density(0.0) < 0.55 / 100
    assert 80 < g.median() < 120
    assert density_priority(1.0) == 80 and density_priority(1e-6) == 1


def test_the_replay_drives_the_routers_own_planner_class():
    """bench/replay_router.py adapts HintPlanner; it defines no policy of its own."""
    tree = ast.parse((ROOT / "bench" / "replay_router.py").read_text())
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "sessionkv.router.hinting"
        for a in n.names
    }
    assert "HintPlanner" in imported
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert classes <= {"Worker", "Router", "NaiveRouter", "PolicyRouter"}, classes
    app = ast.parse((ROOT / "router" / "app.py").read_text())
    assert any(
        isinstance(n, ast.ImportFrom)
        and n.module == "sessionkv.router.hinting"
        and "HintPlanner" in {a.name for a in n.names}
        for n in ast.walk(app)
    )


def test_every_turn_end_retains_the_grown_prefix_even_at_the_same_priority():
    p, clock = policy(strategy="recency")
    p.turn_started("s1", "a", chain(1, 2))
    ((_, _, h1),) = retains(p.turn_ended("s1"))
    clock.now += 5
    p.turn_started("s1", "a", chain(1, 2, 3, 4))
    clock.now += 5
    (_, _, h2), (_, _, h3) = retains(p.turn_ended("s1"))
    assert (h1.target.boundary, h2.target.boundary, h3.target.boundary) == (key(2), key(4), key(2))
    # the first turn's prefix ranks above what grew after it (a return hits a
    # prefix: the growth is worth nothing without its head)
    assert h3.bounds.priority == h2.bounds.priority + HEAD_BOOST


def test_the_router_and_the_replay_run_one_policy_class_on_the_same_events(tmp_path):
    """The proxy's planner and the replay's are both HintPlanner, built from
    the same HintPolicy: on the same events they send the same hints."""
    from replay_router import PolicyRouter
    from replay_sim import Worker as SimWorker
    from replay_trace import SimClock, parse_rows

    from sessionkv.router.app import Router
    from sessionkv.router.config import parse_config

    (tmp_path / "key").write_bytes(b"k" * 32)
    cfg = parse_config(
        {
            "secret_file": str(tmp_path / "key"),
            "redis": {"url": "redis://127.0.0.1:1/0"},
            "workers": [{"name": "0", "url": "http://127.0.0.1:1", "control": "tcp://127.0.0.1:1"}],
        }
    )
    clock = SimClock()
    proxy = Router(cfg, clock)
    tr = parse_rows(
        [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}]
    )
    replay = PolicyRouter(tr, [SimWorker("session", 16, 64, clock, hinted=True)], clock, cfg.policy)
    assert type(proxy.planner) is type(replay.policy) is HintPlanner
    proxy.planner.add_engine("0", 64, 16, 100.0)
    sent = []
    for pol in (proxy.planner, replay.policy):
        outs = pol.turn_started("s1", "0", chain(1, 2)) + pol.turn_ended("s1")
        sent.append(
            [
                (o.worker, o.session, [(a["action_type"], a["payload"]) for a in o.actions])
                for o in outs
            ]
        )
    assert sent[0] == sent[1] and sent[0][0][2][0][0] == "kv.retain"
