"""Unsigned request input on the scheduler thread (issue 54): what a client
that bypasses the router sends is bounded before it is read and cannot grow
the engine's metric series."""

import os
import time
import uuid

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from sessionkv.connectors.metrics import SessionStats
from sessionkv.engine.requests import TOO_BIG, read_request
from sessionkv.events import Outcome
from sessionkv.hints import ACTION_VERSION, MAX_ACTIONS, MAX_KEYS, PROTOCOL_VERSION, sign

SECRET = b"unsigned-input-secret-0123456789"


def env(actions):
    return {"protocol_version": PROTOCOL_VERSION, "message_id": "m", "actions": actions}


def retain(i, keys):
    return {
        "action_id": f"a{i}",
        "action_type": "kv.retain",
        "action_version": ACTION_VERSION,
        "payload": {"target": {"keys": keys}},
    }


def test_a_huge_envelope_is_refused_before_its_signature_or_keys_are_read():
    keys = [os.urandom(8).hex() for _ in range(MAX_KEYS)]
    big = env([retain(i, keys) for i in range(MAX_ACTIONS)])  # 80 MiB as JSON
    forged = f"{int(time.time()) + 10}.{'0' * 64}"  # a signature in its window
    struct = KvHintsEnvelope(
        PROTOCOL_VERSION,
        "m",
        [
            KvHintAction(f"a{i}", "kv.retain", ACTION_VERSION, {"target": {"keys": keys}})
            for i in range(2)
        ],
    )
    fetch = {
        "protocol_version": "kvcr",
        "actions": [{"action_type": "kv.fetch", "payload": {"block_hashes": list(range(MAX_KEYS))}}]
        * 2,
    }
    for params, envelope_ in [
        ({"kv_hints": big}, None),
        ({"kv_hints": big, "kv_hints_sig": forged}, None),
        ({}, struct),  # vLLM's engine API form
        ({"kv_hint": fetch, "kv_hint_sig": forged}, None),
    ]:
        t0 = time.perf_counter()
        got = read_request(params, envelope_, "s", SECRET)
        took = time.perf_counter() - t0
        assert [(o.status.value, o.reason) for o in got.hints] == [("rejected", TOO_BIG)]
        assert took < 0.5, took  # reading it took 2 s
    small = env([retain(0, keys[:8])])  # within the bound: parsed as before
    assert [
        h.action.action_type for h in read_request({"kv_hints": small}, None, "s", SECRET).hints
    ] == ["kv.retain"]
    signed = env([retain(0, keys[: MAX_KEYS - 8]), retain(1, keys[:8])])  # the router's
    got = read_request(
        {"kv_hints": signed, "kv_hints_sig": sign(signed, "s", SECRET)}, None, "s", SECRET
    )
    assert got.signed and len(got.hints) == 2 and got.hints[0].signed


def test_unknown_action_types_add_no_metric_series():
    stats = SessionStats(chunk_bytes=1, blocks_per_chunk=1)
    for _ in range(20):
        actions = [
            {**retain(i, ["00"]), "action_type": f"x-{uuid.uuid4().hex}"}
            for i in range(MAX_ACTIONS)
        ]
        actions[0]["action_type"] = {"nested": "x" * 100}  # not even a string
        for o in read_request({"kv_hints": env(actions)}, None, "s", SECRET).hints:
            assert o.action is None and o.status.value == "rejected", o
            stats.record(Outcome(outcome=o, via="request"))
    series = stats.take(0, 0, 0).reduce()
    assert {k: v for k, v in series.items() if k.startswith("sessionkv:hint_outcomes")} == {
        "sessionkv:hint_outcomes:('none', 'rejected')": 20 * MAX_ACTIONS
    }
