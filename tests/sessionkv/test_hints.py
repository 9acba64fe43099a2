"""Hint wire forms: the vLLM envelope, KVCR's kv.fetch, and the router signature."""

import time

import pytest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from sessionkv.hints import (
    Action,
    Bounds,
    HashesTarget,
    HintOutcome,
    KeysTarget,
    KvHint,
    SessionTarget,
    Status,
    envelope,
    parse_envelope,
    parse_kvcr_fetch,
    sign,
    verify,
)

KEY = bytes(range(36))
SECRET = b"0123456789abcdef-secret"


def envelope(*actions, version="1.0"):
    return {"protocol_version": version, "message_id": "m1", "actions": list(actions)}


def action(kind="kv.pin", payload=None, aid="a1", version="1.0"):
    return {
        "action_id": aid,
        "action_type": kind,
        "action_version": version,
        "payload": {} if payload is None else payload,
    }


def test_each_action_parses_and_defaults_to_the_request_session():
    got = parse_envelope(
        envelope(
            action("kv.pin", {"ttl_s": 30}, "p"),
            action("kv.retain", {"priority": 7, "target": {"session_id": "other"}}, "r"),
            action("kv.demote", {"target": {"branch": KEY.hex()}}, "d"),
            action("kv.prefetch", {"target": {"keys": [KEY.hex()]}, "max_blocks": 4}, "f"),
            action("kv.share", {"destination": "worker-b"}, "s"),
        ),
        session_id="s1",
    )
    assert got == [
        KvHint("p", Action.PIN, SessionTarget("s1"), Bounds(ttl_s=30)),
        KvHint("r", Action.RETAIN, SessionTarget("other"), Bounds(priority=7)),
        KvHint("d", Action.DEMOTE, SessionTarget("s1", branch=KEY)),
        KvHint("f", Action.PREFETCH, KeysTarget((KEY,)), Bounds(max_blocks=4)),
        KvHint("s", Action.SHARE, SessionTarget("s1"), Bounds(destination="worker-b")),
    ]


def test_the_python_engine_api_envelope_parses_the_same():
    env = KvHintsEnvelope("1.0", "m1", [KvHintAction("a1", "kv.pin", "1.0", {"ttl_s": 5})])
    assert parse_envelope(env, "s1") == [
        KvHint("a1", Action.PIN, SessionTarget("s1"), Bounds(ttl_s=5))
    ]


@pytest.mark.parametrize(
    "act, reason",
    [
        (action("kv.evict"), "unknown action_type"),
        (action(version="2.0"), "action_version"),
        (action(aid=""), "action_id"),
        (action(aid=7), "action_id"),
        ("kv.pin", "must be an object"),
        (action(payload=[1]), "payload must be an object"),
        (action(payload={"ttl": 5}), "unknown payload field"),
        (action(payload={"ttl_s": -1}), "ttl_s"),
        (action(payload={"ttl_s": "long"}), "ttl_s"),
        (action(payload={"ttl_s": True}), "ttl_s"),
        (action(payload={"priority": 1.5}), "priority"),
        (action(payload={"max_blocks": 0}), "max_blocks"),
        (action(payload={"target": {"keys": []}}), "target.keys"),
        (action(payload={"target": {"keys": ["zz"]}}), "hex key"),
        (action(payload={"target": {"branch": KEY.hex(), "boundary": KEY.hex()}}), "not both"),
        (action(payload={"target": {"session_id": ""}}), "session_id"),
        (action(payload={"target": {"who": 1}}), "unknown target field"),
    ],
)
def test_a_bad_action_is_rejected_with_a_reason(act, reason):
    (got,) = parse_envelope(envelope(act), "s1")
    assert isinstance(got, HintOutcome) and got.status is Status.REJECTED
    assert reason in got.reason


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "x",
        3,
        [],
        {"actions": []},
        envelope(version="0.9"),
        {"protocol_version": "1.0", "actions": {}},
        envelope(*[action()] * 65),
    ],
)
def test_an_unreadable_envelope_gets_one_outcome(raw):
    (got,) = parse_envelope(raw, "s1")
    assert got.status is Status.REJECTED


def test_no_target_and_no_session_is_rejected():
    (got,) = parse_envelope(envelope(action()), None)
    assert got.status is Status.REJECTED and "session_id" in got.reason


def test_signature_covers_envelope_and_session():
    env = envelope(action(payload={"ttl_s": 30, "target": {"session_id": "s1"}}))
    sig = sign(env, "s1", SECRET)
    same_env_other_order = {
        "actions": env["actions"],
        "message_id": "m1",
        "protocol_version": "1.0",
    }
    assert verify(same_env_other_order, "s1", sig, SECRET)
    assert not verify(env, "s2", sig, SECRET)  # another session
    assert not verify(env, "s1", sig, b"another-secret-0123")
    assert not verify(envelope(action(payload={"ttl_s": 31})), "s1", sig, SECRET)
    assert not verify(env, "s1", sig, None)
    assert not verify(env, "s1", None, SECRET)
    assert not verify({"x": float("nan")}, "s1", sig, SECRET)


def kvcr_fetch(hashes, source="tcp://10.0.0.2:5555", **extra):
    """KVCR's router hint (kvcr.hint_parser's schema), as carried in kv_transfer_params["kv_hint"]."""
    return {
        "protocol_version": "0.1",
        "message_id": "kvcr-1",
        "actions": [
            {
                "action_id": "other",
                "action_type": "kv.retain",
                "action_version": "1.0",
                "payload": {},
            },
            {
                "action_id": "f1",
                "action_type": "kv.fetch",
                "action_version": "1.0",
                "payload": {"source_control_endpoint": source, "block_hashes": hashes, **extra},
            },
        ],
    }


def test_kvcr_fetch_is_a_share_into_this_engine():
    got = parse_kvcr_fetch(kvcr_fetch([7, 2**64 - 1, 7], mode="copy"))
    assert got == KvHint(
        "f1",
        Action.SHARE,
        HashesTarget((7, 2**64 - 1)),
        Bounds(destination="self"),
        source="tcp://10.0.0.2:5555",
    )


@pytest.mark.parametrize(
    "raw",
    [
        kvcr_fetch([]),
        kvcr_fetch([2**64]),
        kvcr_fetch([-1]),
        kvcr_fetch([True]),
        kvcr_fetch(["1"]),
        kvcr_fetch([1], source=""),
        kvcr_fetch([1], mode="move"),
        {**kvcr_fetch([1]), "protocol_version": "1.0"},
        {"actions": "x"},
        None,
    ],
)
def test_bad_kvcr_fetch_is_rejected(raw):
    got = parse_kvcr_fetch(raw)
    assert isinstance(got, HintOutcome) and got.status is Status.REJECTED


def test_a_signature_from_a_clock_apart_says_so():
    from sessionkv.hints import signature_problem

    env, secret, now = envelope(), b"k" * 32, float(int(time.time()))
    sig = sign(env, "s", secret, now=now)
    assert signature_problem(env, "s", sig, secret, now=now) == ""
    ahead = signature_problem(env, "s", sig, secret, now=now + 301)  # the engine 301 s ahead
    assert "expired by 1 s" in ahead and "clocks apart" in ahead, ahead
    assert "another secret" in signature_problem(env, "s", sig, b"j" * 32, now=now)
