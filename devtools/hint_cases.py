"""Hint inputs shared by the fuzz tests: the outcome count each one must get,
and a deterministic generator of hostile (but valid JSON) envelopes."""

import random
from collections.abc import Mapping
from typing import Any

from sessionkv.hints import MAX_ACTIONS, PROTOCOL_VERSION


def expected_count(envelope, kvcr_hint=None) -> int:
    """One outcome per action of a readable envelope, else one; plus KVCR's."""
    n = 0
    if envelope is not None:
        ok = (
            isinstance(envelope, Mapping)
            and envelope.get("protocol_version") == PROTOCOL_VERSION
            and isinstance(envelope.get("actions"), list)
            and len(envelope["actions"]) <= MAX_ACTIONS
        )
        n += len(envelope["actions"]) if ok else 1
    return n + (kvcr_hint is not None)


ACTIONS = ["kv.pin", "kv.retain", "kv.demote", "kv.prefetch", "kv.share", "kv.evict", "", None, 7]
# vLLM answers 400 to integers outside [-2**63, 2**64) before any connector
# sees them, so the live-engine cases stay inside; the in-process fuzz goes beyond.
JUNK: list[Any] = [
    None,
    True,
    -1,
    0,
    1e300,
    -1e300,
    "x" * 5000,
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": {"c": {}}}},
    "zz",
    "00" * 36,
    2**64 - 1,
    -(2**63),
]


def hostile_action(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return rng.choice(JUNK)
    payload = {}
    for field in ("ttl_s", "priority", "max_blocks", "destination", "target", "extra"):
        if rng.random() < 0.4:
            payload[field] = rng.choice(
                JUNK
                + [
                    {"session_id": rng.choice(["s-live", "nobody", "", 3])},
                    {"keys": rng.choice([["00" * 36], [], ["zz"], ["ab"] * 3])},
                    {"branch": "00" * 36, "boundary": "11" * 36},
                ]
            )
    return {
        "action_id": rng.choice(["a", "b" * 200, 5, None, f"h{rng.randrange(99)}"]),
        "action_type": rng.choice(ACTIONS),
        "action_version": rng.choice(["1.0", "1.0", "2.0", None]),
        "payload": payload if rng.random() < 0.9 else rng.choice(JUNK),
    }


def hostile_envelope(rng: random.Random) -> object:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(JUNK)
    n = MAX_ACTIONS + 1 if roll < 0.15 else rng.randrange(0, 5)
    return {
        "protocol_version": rng.choice(["1.0", "1.0", "1.0", "0.1", None]),
        "message_id": rng.choice(["m", "x" * 300, None, 1]),
        "actions": [hostile_action(rng) for _ in range(n)]
        if rng.random() < 0.95
        else rng.choice(JUNK),
    }


def hostile_kvcr(rng: random.Random) -> object:
    if rng.random() < 0.5:
        return None
    return rng.choice(
        JUNK
        + [
            {
                "protocol_version": "0.1",
                "actions": [
                    {
                        "action_type": "kv.fetch",
                        "action_id": "f",
                        "payload": {
                            "source_control_endpoint": rng.choice(["tcp://127.0.0.1:1", "", 5]),
                            "block_hashes": rng.choice([[1, 2], [], [2**64 - 1], ["1"], None]),
                        },
                    }
                ],
            }
        ]
    )
