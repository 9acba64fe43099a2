"""HintExecutor: trust, limits, resolution, one outcome per hint, and a fuzz
of hostile inputs that must never raise."""

import hypothesis.strategies as st
from hypothesis import given, settings
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from sessionkv.config import Limits
from sessionkv.devtools.cost import lines_run
from sessionkv.devtools.hint_cases import expected_count
from sessionkv.devtools.keys import block_key
from sessionkv.engine import executor as hint_executor
from sessionkv.engine import waits
from sessionkv.engine.executor import HintExecutor
from sessionkv.engine.requests import read_request_hints
from sessionkv.engine.waits import WAIT_S, Turn
from sessionkv.hints import SIG_PARAM, Status, sign
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.types import Tier

SECRET = b"0123456789abcdef-secret"
A, B, C = (block_key(i) for i in (1, 2, 3))


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def setup(g2_chunks=100, **limits):
    idx = SessionPrefixIndex(max_tombstones=4)
    idx.admit("s1", [A, B, C], Tier.G2)
    idx.admit("gone", [A], None)
    idx.end_session("gone")
    policy = SessionCachePolicy(g2_chunks)
    for i, k in enumerate((A, B, C)):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(k, chunk)
    clock = Clock()
    return idx, HintExecutor(idx, Limits(**limits), policy, g2_chunks, 1, clock), clock


def env(*payloads, kind="kv.pin"):
    return {
        "protocol_version": "1.0",
        "message_id": "m",
        "actions": [
            {"action_id": f"h{i}", "action_type": kind, "action_version": "1.0", "payload": p}
            for i, p in enumerate(payloads)
        ],
    }


def run(ex, session, envelope, signed_for=None):
    params = {"kv_hints": envelope}
    if signed_for is not None:
        params[SIG_PARAM] = sign(envelope, signed_for, SECRET)
    return ex.execute_all(read_request_hints(params, None, session, SECRET), session)


def test_unsigned_is_rejected_signed_is_resolved_wrong_session_rejected():
    _, ex, _ = setup()
    e = env({"ttl_s": 30})
    (out,) = run(ex, "s1", e)
    assert out.status is Status.REJECTED and "unsigned" in out.reason
    (out,) = run(ex, "s1", e, signed_for="s1")
    assert (out.status, out.blocks_asked, out.blocks_affected) == (Status.ACCEPTED, 3, 3)
    (out,) = run(ex, "s1", e, signed_for="s2")
    assert out.status is Status.REJECTED and "unsigned" in out.reason


def test_missing_targets_say_why():
    _, ex, _ = setup()
    outs = run(
        ex,
        "s1",
        env(
            {"target": {"session_id": "nobody"}},
            {"target": {"session_id": "gone"}},
            {"target": {"branch": A.hex()}},
            {"target": {"keys": [bytes(36).hex()]}},
        ),
        signed_for="s1",
    )
    assert [o.status for o in outs] == [Status.MISSING] * 4
    assert [o.reason for o in outs] == [
        "unknown session",
        "session ended",
        "branch or boundary is not part of the session",
        "none of the keys is resident",
    ]


def test_unsigned_pins_only_within_their_quota_and_own_session():
    _, ex, _ = setup(g2_chunks=40, unsigned_pin_fraction=0.05)  # 2 unsigned chunks
    (own,) = run(ex, "s1", env({}))
    (other,) = run(ex, "s1", env({"target": {"session_id": "s2"}}))
    (retain,) = run(ex, "s1", env({}, kind="kv.retain"))
    assert (own.status, own.blocks_affected, own.reason) == (
        Status.CLIPPED,
        2,
        "pin quota: 1 chunks not pinned",
    )
    assert "unsigned" in other.reason and "unsigned" in retain.reason


def test_rate_limit_per_client():
    _, ex, clock = setup(hints_per_s_per_client=2)
    outs = run(ex, "s1", env({}, {}, {}), signed_for="s1")
    assert [o.reason for o in outs] == ["", "", "rate limit exceeded"]
    clock.t += 1.0
    assert run(ex, "s1", env({}), signed_for="s1")[0].status is Status.ACCEPTED


# ---- fuzz -----------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4)
    ),
    max_leaves=12,
)
keys = st.sampled_from([A.hex(), B.hex(), C.hex(), "zz", "", bytes(36).hex()])
payloads = st.fixed_dictionaries(
    {},
    optional={
        "ttl_s": st.floats(allow_nan=False) | st.integers(-10, 10**12) | json_values,
        "priority": st.integers(-5, 10**7) | json_values,
        "max_blocks": st.integers(-1, 10**6) | json_values,
        "destination": st.text(max_size=200) | json_values,
        "target": st.fixed_dictionaries(
            {},
            optional={
                "session_id": st.sampled_from(["s1", "gone", "nobody", ""]) | json_values,
                "branch": keys | json_values,
                "boundary": keys,
            },
        )
        | st.fixed_dictionaries({"keys": st.lists(keys, max_size=4) | json_values}),
        "junk": json_values,
    },
)
actions = (
    st.fixed_dictionaries(
        {
            "action_id": st.text(max_size=150) | json_values,
            "action_type": st.sampled_from(
                [
                    "kv.pin",
                    "kv.retain",
                    "kv.demote",
                    "kv.prefetch",
                    "kv.share",
                    "kv.evict",
                    "kv.fetch",
                ]
            )
            | json_values,
            "action_version": st.sampled_from(["1.0", "2.0"]) | json_values,
            "payload": payloads | json_values,
        }
    )
    | json_values
)
envelopes = (
    st.fixed_dictionaries(
        {
            "protocol_version": st.sampled_from(["1.0", "0.1"]) | json_values,
            "message_id": st.text(max_size=200) | json_values,
            "actions": st.lists(actions, max_size=6)
            | st.lists(st.just({}), min_size=65, max_size=66)
            | json_values,
        }
    )
    | json_values
)
kvcr = (
    st.none()
    | json_values
    | st.fixed_dictionaries(
        {
            "protocol_version": st.sampled_from(["0.1", "1.0"]),
            "actions": st.lists(
                st.fixed_dictionaries(
                    {
                        "action_type": st.just("kv.fetch"),
                        "action_id": st.text(max_size=5),
                        "payload": st.fixed_dictionaries(
                            {
                                "source_control_endpoint": st.text(max_size=10) | json_values,
                                "block_hashes": st.lists(st.integers(-1, 2**65), max_size=4)
                                | json_values,
                            }
                        ),
                    }
                ),
                max_size=2,
            ),
        }
    )
)


@settings(max_examples=10_000, deadline=None)
@given(
    envelope=envelopes,
    kvcr_hint=kvcr,
    session=st.sampled_from(["s1", "gone", None, "x"]),
    signing=st.sampled_from(["good", "other-session", "garbage", "none"]),
)
def test_fuzz_never_raises_and_gives_one_outcome_per_hint(envelope, kvcr_hint, session, signing):
    _, ex, _ = setup(unsigned_pin_fraction=0.1)
    params = {}
    if envelope is not None:
        params["kv_hints"] = envelope
    if kvcr_hint is not None:
        params["kv_hint"] = kvcr_hint
    try:
        sig = {
            "good": sign(envelope, session or "", SECRET),
            "other-session": sign(envelope, "someone-else", SECRET),
        }.get(signing, signing)
    except (TypeError, ValueError):
        sig = "garbage"
    params[SIG_PARAM] = None if signing == "none" else sig
    outs = ex.execute_all(read_request_hints(params, None, session, SECRET), session)
    assert len(outs) == expected_count(envelope, kvcr_hint)
    for o in outs:
        assert o.status in Status and isinstance(o.hint_id, str)
        if o.status in (Status.ACCEPTED, Status.CLIPPED):
            assert o.action in ("kv.pin", "kv.retain")  # the only actions that exist


def test_pin_quotas_per_session_and_global_and_ttl_clamp():
    idx, ex, _ = setup(g2_chunks=8, pin_fraction_session=0.25, max_ttl_s=60)  # 2 per session
    (o,) = run(ex, "s1", env({"ttl_s": 600}), signed_for="s1")
    assert (o.status, o.blocks_affected) == (Status.CLIPPED, 2)
    assert "ttl clipped to 60 s" in o.reason and "pin quota" in o.reason
    (o,) = run(ex, "s1", env({"ttl_s": 30}), signed_for="s1")  # re-pin: TTL refreshed
    assert (o.status, o.blocks_affected) == (Status.CLIPPED, 2)


def test_retain_and_missing_in_g2():
    idx, ex, _ = setup()
    (o,) = run(ex, "s1", env({"priority": 3}, kind="kv.retain"), signed_for="s1")
    assert (o.status, o.blocks_affected) == (Status.ACCEPTED, 3)
    idx.admit("s9", [bytes([9]) * 36], Tier.G1)  # resident, but not in G2
    (o,) = run(ex, "s9", env({}), signed_for="s9")
    assert (o.status, o.reason) == (Status.MISSING, "none of the target is in G2")


def test_a_retain_up_to_an_evicted_boundary_takes_the_sessions_deepest_branch():
    """A router's re-rank names the last prompt's last block; once that block
    is evicted (and pruned from the index) the Retain takes what is left of
    the session's deepest branch instead of missing (its blocks would keep
    their old priority), clipped: what was evicted is not held. A Pin, which
    uses quota, still misses."""
    idx, ex, _ = setup()
    D = block_key(4)
    idx.admit("s1", [A, B, C, D], Tier.G2, start=3)
    idx.set_copies(Tier.G2, [D], 0)  # D evicted: the frontier is C
    assert D not in idx
    (o,) = run(
        ex,
        "s1",
        env({"target": {"boundary": D.hex()}, "priority": 7}, kind="kv.retain"),
        signed_for="s1",
    )
    assert (o.status, o.blocks_affected, o.reason) == (
        Status.CLIPPED,
        3,
        "boundary evicted: the session's deepest branch",
    )
    assert {ex._policy._retains[k][0] for k in (A, B, C)} == {7}
    (o,) = run(ex, "s1", env({"target": {"boundary": D.hex()}, "ttl_s": 5}), signed_for="s1")
    assert (o.status, o.reason) == (Status.MISSING, "branch or boundary is not part of the session")


def test_pins_clipped_under_pressure_come_back_as_late_outcomes():
    _, ex, _ = setup(g2_chunks=3, pin_fraction_session=1.0, pin_fraction_global=1.0)
    (o,) = run(ex, "s1", env({"ttl_s": 60}), signed_for="s1")
    assert o.blocks_affected == 3
    policy = ex._policy
    assert len(policy.evict(2, set())) == 2  # nothing but pins left: clipped
    (late,) = ex.collect_clipped()
    assert (late.hint_id, late.status, late.blocks_affected) == ("h0", Status.CLIPPED, 2)
    assert ex.collect_clipped() == []


def _pinned_sessions(others: int):
    """An executor with ``others`` sessions of one pinned chunk each, and
    session "me" with three."""
    idx = SessionPrefixIndex(max_tombstones=4)
    policy = SessionCachePolicy(others + 16)
    ex = HintExecutor(
        idx,
        Limits(pin_fraction_session=1.0, pin_fraction_global=1.0),
        policy,
        others + 16,
        1,
        Clock(),
    )
    sessions = [(f"o{i}", [block_key(1000 + i)]) for i in range(others)]
    sessions.append(("me", [block_key(i) for i in (1, 2, 3)]))
    for i, (sid, keys) in enumerate(sessions):
        idx.admit(sid, keys, Tier.G2)
        for j, k in enumerate(keys):
            chunk = ChunkStatus(3 * i + j)
            chunk.ref_cnt = 0
            policy.insert(k, chunk)
        (o,) = run(ex, sid, env({"ttl_s": 60}), signed_for=sid)
        assert o.status is Status.ACCEPTED
    return ex


def test_a_pin_and_a_session_end_cost_their_own_pins_not_everyones():
    # Issue "production scale": expiring 1,000 sessions with 16k pins live
    # took 1.56 s, each release and each Pin scanning every live pin.
    FILES = ("engine/", "tiers/g2/")

    def costs(others):
        ex = _pinned_sessions(others)
        hint = read_request_hints(
            {"kv_hints": env({"ttl_s": 90}), SIG_PARAM: sign(env({"ttl_s": 90}), "me", SECRET)},
            None,
            "me",
            SECRET,
        )
        pin = lines_run(lambda: ex.execute_all(hint, "me"), FILES)
        step = lines_run(ex.collect_clipped, FILES)
        end = lines_run(lambda: ex.release("me"), FILES)
        assert ex.pinned_chunks == others
        return pin, step, end

    few, many = costs(10), costs(2000)
    assert many == few, (few, many)


def test_status_lists_the_pins_of_the_sessions_it_shows_at_their_cost():
    # The status op lists pins under the lock: it must cost the sessions it
    # shows, not the 16k pins an engine may hold.
    costs = []
    for others in (10, 2000):
        ex, got = _pinned_sessions(others), []
        costs.append(
            lines_run(lambda: got.append(ex.pins(["me", "nobody"])), ("engine/", "tiers/g2/"))
        )
        ((p,),) = got
        assert (p["session_id"], p["hint_id"], p["chunks"]) == ("me", "h0", 3)
        assert 50 < p["expires_in_s"][0] <= p["expires_in_s"][1] <= 60  # the policy's clock
    assert costs[0] == costs[1], costs


def _turn_setup(g2_chunks=100):
    """Session s1 of five blocks after a turn: G2 holds the first three, the
    last two are still on their way (a real index and SessionCachePolicy;
    the engine-level test is tests/connectors/test_turn_hints.py)."""
    idx = SessionPrefixIndex(max_tombstones=4)
    keys = [block_key(10 + i) for i in range(5)]
    idx.admit("s1", keys, Tier.G1)
    policy = SessionCachePolicy(g2_chunks)
    for i, k in enumerate(keys[:3]):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(k, chunk)
    clock, told = Clock(), []
    ex = HintExecutor(
        idx,
        Limits(pin_fraction_session=1.0, pin_fraction_global=1.0),
        policy,
        g2_chunks,
        1,
        clock,
        emit=lambda o, via, s: told.append((o, via, s)),
    )
    return ex, policy, keys, clock, told


def _turn_pin(ex, keys, rid="r1"):
    hints = read_request_hints(
        {"kv_hints": env({"ttl_s": 60}), SIG_PARAM: sign(env({"ttl_s": 60}), "s1", SECRET)},
        None,
        "s1",
        SECRET,
    )
    (o,) = ex.execute_all(hints, "s1", turn=Turn(rid, keys))
    return o


def _stored(policy, k, slot):
    chunk = ChunkStatus(slot)
    chunk.ref_cnt = 0
    policy.insert(k, chunk)


def test_a_turns_pin_holds_its_last_chunks_as_they_arrive_and_reports_the_ones_lost():
    from sessionkv.events import Via

    ex, policy, keys, _, told = _turn_setup()
    o = _turn_pin(ex, keys)
    assert (o.status, o.blocks_affected) == (Status.ACCEPTED, 5)  # the two on their way count
    assert ex.waiting
    assert [policy.pin_expiry(k) is not None for k in keys] == [True] * 3 + [False] * 2
    _stored(policy, keys[3], 3)
    ex.stored([keys[3]], True)  # vLLM's store of the fourth ended
    assert policy.pin_expiry(keys[3]) is not None and ex.pinned_chunks == 4 and not told
    ex.request_done("r1")  # vLLM's last stores left out the fifth
    assert not ex.waiting
    ((late, via, session),) = told
    assert (late.hint_id, late.status, late.blocks_affected, via, session) == (
        "h0",
        Status.CLIPPED,
        1,
        Via.POLICY,
        "s1",
    )
    assert late.reason == "1 of the turn's last chunks not pinned: not stored in G2"


def test_a_turns_waits_end_on_failed_stores_and_at_their_deadline():
    ex, policy, keys, clock, told = _turn_setup()
    _turn_pin(ex, keys)
    ex.stored([keys[3]], False)  # a failed store: lost at once
    clock.t = WAIT_S - 1
    ex.collect_clipped()
    assert ex.waiting and not told
    clock.t = WAIT_S + 1  # nothing came for the fifth
    ex.collect_clipped()
    ((late, _, _),) = told
    assert (
        late.reason == "2 of the turn's last chunks not pinned: "
        f"not there {WAIT_S:g} s after the request finished"
    )
    assert ex._n_waiting == 0


def test_waiting_chunks_are_bounded(monkeypatch):
    monkeypatch.setattr(waits, "MAX_WAITING_CHUNKS", 1)
    ex, policy, keys, _, told = _turn_setup()
    o = _turn_pin(ex, keys)
    assert (o.status, o.blocks_affected) == (Status.CLIPPED, 4)
    assert "1 of the turn's last chunks not held: too many chunks waiting" in o.reason
    o = _turn_pin(ex, keys, rid="r2")  # no room left: resident chunks only
    assert (o.status, o.blocks_affected) == (Status.CLIPPED, 3)
    assert ex._n_waiting == 1


def test_a_large_pin_or_retain_acts_a_slice_per_hold_and_reports_what_it_lost(monkeypatch):
    # Issue 52: a Pin or Retain acted on all of its G2 chunks in one hold of
    # the lock (a 16,384-chunk Pin: 81 ms in the policy alone). Now a slice
    # at once, the rest a slice per step(), with wake() while some are left.
    monkeypatch.setattr(hint_executor, "G2_SLICE_CHUNKS", 4)  # the first slice
    monkeypatch.setattr(waits, "G2_SLICE_CHUNKS", 4)  # the later ones (step)
    keys = [block_key(f"big{i}") for i in range(10)]
    idx = SessionPrefixIndex()
    idx.admit("s", keys, Tier.G2)
    policy = SessionCachePolicy(100)
    for i, k in enumerate(keys):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(k, chunk)
    woken, late = [], []
    ex = HintExecutor(
        idx,
        Limits(pin_fraction_session=0.08),
        policy,
        100,
        1,
        Clock(),
        emit=lambda o, via, s: late.append(o),
        wake=lambda: woken.append(1),
    )
    (out,) = run(ex, "s", env({"ttl_s": 30}), signed_for="s")
    assert (out.status, out.blocks_affected) == (Status.ACCEPTED, 10)
    assert policy.pinned() == set(keys[:4]) and woken
    policy.remove(keys[5])  # gone from G2 before its slice
    ex.step()
    assert policy.pinned() == set(keys[:8]) - {keys[5]} and late == []
    ex.step()  # the quota (8 chunks) refuses the last
    assert policy.pinned() == set(keys) - {keys[5], keys[9]}
    (clip,) = late
    assert (clip.hint_id, clip.status, clip.blocks_affected) == ("h0", Status.CLIPPED, 2)
    assert clip.reason == "2 chunks not pinned: pin quota"
    woken.clear()
    ex.step()
    assert not woken  # nothing left
    # A Retain past its slice, cut by a reset: the rest is reported lost.
    (out,) = run(ex, "s", env({"ttl_s": 30, "priority": 7}, kind="kv.retain"), signed_for="s")
    assert out.status is Status.ACCEPTED
    ex.drop_waiting("G2 was reset")
    assert late[-1].reason == "5 chunks not retained: G2 was reset"
