"""One identifier check on every path (``sessionkv.hints.id_problem``): odd
strings become a rejected outcome naming the field, and every outcome stays
encodable; clients read replies of newer engines (unknown event kinds are
skipped) and raise ``ControlError``, never a decoder's error."""

import msgspec
import pytest

from sessionkv import control as wire
from sessionkv.client import ControlError, HintClient
from sessionkv.engine.requests import read_request_hints
from sessionkv.events import Outcome
from sessionkv.hints import (
    PROTOCOL_VERSION,
    HintOutcome,
    id_problem,
    parse_envelope,
    parse_kvcr_fetch,
)

ODD = ["\ud800", "a\x00b", "tab\there", "\x9b", "", "x" * 129]
SECRET = b"s" * 16


def envelope(payload, aid="a1"):
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": "m1",
        "actions": [
            {"action_type": "kv.pin", "action_version": "1.0", "action_id": aid, "payload": payload}
        ],
    }


def encodable(outcomes):
    msgspec.msgpack.encode(outcomes)  # raises on a lone surrogate
    msgspec.json.encode(outcomes)


@pytest.mark.parametrize("value", ODD + [5, None])
def test_odd_identifiers_are_named_problems(value):
    assert "session_id" in id_problem(value, "session_id")


def test_good_identifiers_pass():
    for value in ("s1", "é" * 128, "agent/42:turn-7", "日本"):
        assert id_problem(value, "session_id") == ""


@pytest.mark.parametrize("value", ODD)
def test_odd_ids_in_envelopes_are_rejected_and_encodable(value):
    (by_action,) = parse_envelope(envelope({"ttl_s": 5}, aid=value), "s1")
    assert isinstance(by_action, HintOutcome) and by_action.status == "rejected"
    assert "action_id" in by_action.reason
    (by_target,) = parse_envelope(envelope({"target": {"session_id": value}}), "s1")
    assert by_target.status == "rejected" and "target.session_id" in by_target.reason
    (by_dest,) = parse_envelope(envelope({"destination": value}), "s1")
    assert by_dest.status == "rejected" and "destination" in by_dest.reason
    fetch = parse_kvcr_fetch(
        {
            "protocol_version": "0.1",
            "message_id": value,
            "actions": [
                {
                    "action_type": "kv.fetch",
                    "action_id": value,
                    "payload": {
                        "source_control_endpoint": "tcp://h:1\x00" + value,
                        "block_hashes": [1],
                    },
                }
            ],
        }
    )
    assert fetch.status == "rejected" and "source_control_endpoint" in fetch.reason
    encodable([by_action, by_target, by_dest, fetch])


@pytest.mark.parametrize("value", ["\ud800", "a\x00b", "x" * 500, 7])
def test_a_request_with_an_odd_session_id_gets_one_rejected_outcome(value):
    out = read_request_hints({}, envelope({"ttl_s": 5}), value, SECRET)
    assert [(o.status, "session_id" in o.reason) for o in out] == [("rejected", True)]
    encodable(out)
    assert read_request_hints({}, None, value, SECRET) == []  # no hints: nothing to say


def test_a_reply_with_an_event_kind_this_client_does_not_know_skips_it():
    known = msgspec.to_builtins(
        Outcome(seq=2, outcome=HintOutcome("h", "pin", "accepted"), via="control")
    )
    payload = msgspec.msgpack.encode(
        {
            "counter": 1,
            "events": [
                {"kind": "from-a-newer-engine", "seq": 1, "whatever": [1, 2]},
                known,
                {**known, "seq": 3, "a_new_field": True},
            ],
        }
    )
    reply, skipped = wire.decode_reply(payload)
    assert skipped == 1 and [e.seq for e in reply.events] == [2, 3]


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode({"counter": "one"}), msgspec.msgpack.encode([1, 2, 3])],
)
def test_an_authentic_but_undecodable_reply_is_a_control_error(payload):
    with HintClient("tcp://127.0.0.1:9", SECRET, timeout_s=0.1) as c:
        with pytest.raises(ControlError, match="undecodable"):
            c._reply([payload, wire.mac(wire.REPLY_DOMAIN, payload, SECRET)], None)


@pytest.mark.parametrize("client_id", ["\ud800", "a\x00", "x" * 200])
def test_a_client_refuses_an_odd_client_id(client_id):
    with pytest.raises(ValueError, match="client_id"):
        HintClient("tcp://127.0.0.1:9", SECRET, client_id=client_id)
