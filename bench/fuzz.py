"""Fuzz every parser and handler that reads input from outside the process.

    .venv/bin/python bench/fuzz.py --examples N --json OUT [--targets a,b]

Per target, ``N`` examples from hypothesis (valid documents mutated field by
field, arbitrary JSON values, odd strings: lone surrogates, control
characters, long ones; random and authentic msgpack frames) go through the
product's own code. An example is *unexpected* when it raises anything but
the documented error of that parser, or when what it returns cannot be
encoded (outcomes and replies go on the wire). The JSON is
``{"examples": N, "targets": {name: {examples, unexpected, first}}}``,
``first`` the first unexpected example and its error.

The control channel's handler runs on a real ``ControlChannel`` (loopback
sockets) over a stand-in manager that answers every op with what a real
one returns for a valid call: the handler's checks are what is fuzzed here;
the hint executor's own fuzz is in ``tests/connectors/test_hint_executor.py``.
The router's HTTP handler runs in a real ``Router`` on a loopback port, its
Redis unreachable and no worker started: a turn gets a 4xx for bad input, a
503 or 502 for no worker, never a 500. YAML files go through both config
files' loaders (anchors and aliases, deep nesting, odd text): a ValueError.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sessionkv import control as wire
from sessionkv.client import ControlError, HintClient
from sessionkv.config import load_policy_file, parse_policy
from sessionkv.connectors.metrics import SessionStats
from sessionkv.engine.requests import read_request
from sessionkv.events import EventLog
from sessionkv.events import decode as decode_event
from sessionkv.hints import (
    HintOutcome,
    KvHint,
    Status,
    parse_envelope,
    parse_kvcr_fetch,
    sign,
    verify,
)
from sessionkv.router.config import load_config, parse_config
from sessionkv.router.overlap import PROBE_TOKENS, BlockHasher, ProbeMismatch
from sessionkv.router.workers import _metric_sum

SECRET = b"fuzz-cluster-secret-0123456789"
ODD = [
    "",
    "\ud800",
    "\udfff",
    "a\x00b",
    "\x7f",
    "\x9b",
    "é",
    "🙂",
    "x" * 129,
    "x" * 5000,
    "1.0",
    "0.1",
    "kv.pin",
    "kv.fetch",
    "s1",
    "tcp://127.0.0.1:1",
    "00" * 36,
    "zz",
    "\n",
]
KEYS = [
    "protocol_version",
    "message_id",
    "actions",
    "action_type",
    "action_id",
    "action_version",
    "payload",
    "target",
    "session_id",
    "branch",
    "boundary",
    "keys",
    "ttl_s",
    "priority",
    "destination",
    "max_blocks",
    "mode",
    "block_hashes",
    "source_control_endpoint",
    "version",
    "g2",
    "g3",
    "limits",
    "sessions",
    "trust",
    "block_size",
    "hash_algo",
    "hash_root",
    "kind",
    "seq",
    "counter",
    "events",
    "info",
]

TEXT = st.one_of(
    st.sampled_from(ODD),
    st.text(max_size=40),
    st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0xFFFF), max_size=20),
)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 70000),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.binary(max_size=40),
)
JSON = st.recursive(
    SCALAR,
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), TEXT), c, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw, base):
    """``base`` with some values replaced, some keys dropped, some added."""

    def walk(v):
        roll = draw(st.integers(0, 9))
        if roll == 0:
            return draw(JSON)
        if isinstance(v, dict):
            out = {k: walk(x) for k, x in v.items() if draw(st.integers(0, 12))}
            if draw(st.integers(0, 6)) == 0:
                out[draw(st.one_of(st.sampled_from(KEYS), TEXT))] = draw(JSON)
            return out
        if isinstance(v, list):
            return [walk(x) for x in v] + ([draw(JSON)] if draw(st.integers(0, 6)) == 0 else [])
        return v

    return walk(base)


def either(base):
    return st.one_of(mutated(base), JSON)


ENVELOPE = {
    "protocol_version": "1.0",
    "message_id": "m1",
    "actions": [
        {
            "action_type": "kv.pin",
            "action_version": "1.0",
            "action_id": "a1",
            "payload": {
                "target": {"session_id": "s1", "branch": "00" * 36},
                "ttl_s": 30,
                "priority": 5,
                "destination": "b",
                "max_blocks": 8,
            },
        },
        {
            "action_type": "kv.prefetch",
            "action_version": "1.0",
            "action_id": "a2",
            "payload": {"target": {"keys": ["00" * 36]}},
        },
    ],
}
FETCH = {
    "protocol_version": "0.1",
    "message_id": "f1",
    "actions": [
        {
            "action_type": "kv.fetch",
            "action_id": "f1",
            "payload": {
                "source_control_endpoint": "tcp://127.0.0.1:5",
                "block_hashes": [1, 2],
                "mode": "copy",
            },
        }
    ],
}
POLICY = {
    "version": 1,
    "g2": {"eviction": "session"},
    "g3": {"write_through": True},
    "sessions": {"idle_timeout_s": 60, "max_tombstones": 10},
    "limits": {
        "max_ttl_s": 600,
        "max_blocks_per_hint": 100,
        "pin_fraction_session": 0.5,
        "pin_fraction_global": 0.8,
        "hints_per_s_per_client": 100,
        "unsigned_pin_fraction": 0.1,
    },
    "report": {"per_tier": "signed"},
}
PROBE = {
    "block_size": 32,
    "hash_algo": "sha256",
    "hash_root": "00" * 32,
    "block_hashes": ["00" * 32] * 6,
}


def router_doc(secret_file: str) -> dict:
    return {
        "version": 1,
        "listen": {"host": "127.0.0.1", "port": 8100},
        "secret_file": secret_file,
        "redis": {"url": "redis://127.0.0.1:6379/1", "namespace": "r", "state_ttl_s": 60},
        "workers": [
            {"name": "a", "url": "http://127.0.0.1:8001", "control": "tcp://127.0.0.1:5700"}
        ],
        "routing": {"max_load": 4, "load_poll_s": 0.5, "overlap": True},
        "policy": {
            "on_end": "demote",
            "tick_s": 1,
            "tool_call": {"pin": True, "expected_gap_s": 60, "pin_ttl_factor": 1.5},
        },
    }


def encodable(value) -> None:
    msgspec.msgpack.encode(value)
    msgspec.json.encode(value)


def outcomes_ok(out) -> None:
    """Hints and outcomes, each encodable (a hint's ids end up in its outcome)."""
    assert isinstance(out, list) and all(isinstance(o, (HintOutcome, KvHint)) for o in out), out
    encodable(out)


class _StandInManager:
    """What a real manager answers for valid calls (see the module docstring)."""

    def __init__(self):
        self.event_log = EventLog()
        self.mover = None
        self.stats = SessionStats(1, 1)  # the real one: the channel times each op into it

    def control_hints(self, items, session_id, client):
        return [
            i
            if isinstance(i, HintOutcome)
            else HintOutcome(i.hint_id, i.action.action_type, Status.ACCEPTED)
            for i in items
        ]

    def end_session(self, session_id):
        return False

    def emit_outcomes(self, outcomes, via, session_id, client):
        encodable(outcomes)

    def status(self):
        return {"sessions": 0}

    def resolve_hashes(self, hashes):
        return []

    def apply_moves(self):
        return


def frame_payloads():
    """Control request payloads: valid requests mutated, and anything."""
    base = {
        "client": "fuzz",
        "counter": 0,
        "op": "hints",
        "session_id": "s1",
        "hints": ENVELOPE,
        "after": 0,
        "limit": 10,
        "block_hashes": [1],
        "tokens": [1, 2],
    }
    ops = st.sampled_from(list(wire.OPS) + ["nope"])
    return st.one_of(
        st.builds(lambda d, op: {**d, "op": op} if isinstance(d, dict) else d, mutated(base), ops),
        JSON,
    )


def targets(tmp: Path) -> dict:
    """name -> (strategy, check(example)); check raises on an unexpected result."""
    secret_file = tmp / "secret"
    secret_file.write_bytes(SECRET)
    from sessionkv.engine.control import ControlChannel

    channel = ControlChannel(_StandInManager(), SECRET)  # sockets only: no thread started

    def envelope(ex):
        doc, sid = ex
        outcomes_ok(parse_envelope(doc, sid))

    def kv_fetch(doc):
        outcomes_ok([parse_kvcr_fetch(doc)])

    def sign_verify(ex):
        doc, sid, sig = ex
        assert verify(doc, sid, sig, SECRET) in (True, False)
        if isinstance(sid, str):
            try:
                good = sign(doc, sid, SECRET)
            except (TypeError, ValueError):  # documented: not JSON, or odd strings
                return
            assert verify(doc, sid, good, SECRET)

    def request_hints(ex):
        params, env, sid = ex
        got = read_request(params, env, sid, SECRET)
        outcomes_ok(got.hints)
        assert got.signed in (True, False)

    def control_frames(ex):
        doc, authentic, raw = ex
        try:
            payload = msgspec.msgpack.encode(
                {**doc, "counter": time.time_ns()}
                if isinstance(doc, dict) and doc.get("counter") == 0
                else doc
            )
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            payload = raw
        tag = wire.mac(wire.REQUEST_DOMAIN, payload, SECRET) if authentic else raw[:32]
        reply = channel._handle([payload, tag])
        assert isinstance(reply, wire.ControlReply)
        wire.request_encoder.encode(reply)

    client = HintClient("tcp://127.0.0.1:9", SECRET, timeout_s=0.01)

    def client_replies(ex):
        doc, raw = ex
        try:
            payload = msgspec.msgpack.encode(doc)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            payload = raw
        try:
            client._reply([payload, wire.mac(wire.REPLY_DOMAIN, payload, SECRET)], None)
        except ControlError:
            pass

    def event_decoding(ex):
        doc, raw = ex
        for payload in (raw, _pack(doc)):
            try:
                decode_event(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass

    def router_config(doc):
        try:
            parse_config(doc)
        except ValueError:
            pass

    def policy_config(doc):
        try:
            parse_policy(doc)
        except ValueError:
            pass

    def probe_replies(doc):
        try:
            BlockHasher.from_probe(doc, PROBE_TOKENS)
        except ProbeMismatch:
            pass

    def metrics_text(text):
        total, bad = _metric_sum(text, "vllm:num_requests_running")
        assert math.isfinite(total) and bad >= 0

    def yaml_files(text):
        path = tmp / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        for load in (load_policy_file, load_config):
            try:
                load(str(path))
            except ValueError:
                pass

    http = _RouterUnderFuzz(tmp, secret_file)

    def router_handler(ex):
        path, raw, headers = ex
        status = http.post(path, raw, headers)
        assert status < 500 or status in (502, 503), status

    sid = st.one_of(st.none(), TEXT, SCALAR)
    metric_line = st.builds(
        lambda labels, value: f"vllm:num_requests_running{labels} {value}",
        st.sampled_from(["", "{x}", '{a="b c"}', "{", "}"]),
        st.one_of(TEXT, st.floats().map(str)),
    )
    return {
        "envelope": (st.tuples(either(ENVELOPE), sid), envelope),
        "kv_fetch": (either(FETCH), kv_fetch),
        "sign_verify": (st.tuples(either(ENVELOPE), sid, sid), sign_verify),
        "request_hints": (
            st.tuples(
                either({"kv_hints": ENVELOPE, "kv_hint": FETCH, "kv_hints_sig": "00"}),
                st.one_of(st.none(), either(ENVELOPE)),
                sid,
            ),
            request_hints,
        ),
        "control_frames": (
            st.tuples(frame_payloads(), st.booleans(), st.binary(max_size=64)),
            control_frames,
        ),
        "client_replies": (
            st.tuples(
                either(
                    {
                        "counter": 1,
                        "ok": True,
                        "events": [{"kind": "eviction", "seq": 1, "tier": "G2", "keys": [b"k"]}],
                        "outcomes": [{"hint_id": "h", "action": "kv.pin", "status": "accepted"}],
                    }
                ),
                st.binary(max_size=64),
            ),
            client_replies,
        ),
        "event_decoding": (
            st.tuples(
                either({"kind": "association", "seq": 1, "session_id": "s", "op": "extend"}),
                st.binary(max_size=64),
            ),
            event_decoding,
        ),
        "router_config": (either(router_doc(str(secret_file))), router_config),
        "policy_config": (either(POLICY), policy_config),
        "probe_replies": (either(PROBE), probe_replies),
        "metrics_text": (
            st.lists(st.one_of(metric_line, TEXT), max_size=6).map("\n".join),
            metrics_text,
        ),
        "yaml_files": (yaml_text(), yaml_files),
        "router_handler": (
            st.tuples(
                st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                st.one_of(
                    either(
                        {
                            "model": "m",
                            "prompt": [1, 2, 3],
                            "max_tokens": 1,
                            "session_id": "s1",
                            "stream": False,
                            "kv_transfer_params": {"kv_hints": ENVELOPE},
                        }
                    ).map(_json_bytes),
                    st.binary(max_size=64),
                    st.sampled_from(DEEP),
                ),
                st.dictionaries(
                    st.sampled_from(
                        ["X-Session-ID", "X-Session-Tool-Gap", "Authorization", "Content-Type"]
                    ),
                    st.one_of(
                        st.sampled_from(
                            [
                                "default",
                                "5",
                                "-1",
                                "nan",
                                "1e999",
                                "Bearer k",
                                "application/json",
                                "application/json; charset",
                                "text/plain; ;=x",
                                "a;b*",
                            ]
                        ),
                        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
                    ),
                    max_size=4,
                ),
            ),
            router_handler,
        ),
    }, (channel, client, http)


DEEP = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"kv_transfer_params": [1]}',
    b'{"session_id": "\\u0000"}',
    b"null",
    b'"x"',
]
YAML_PARTS = [
    "version: 1\n",
    "a: &a [x, x, x]\n",
    "b: [*a, *a, *a]\n",
    "c: *a\n",
    "g2: " + "[" * 200 + "]" * 200 + "\n",
    "limits: {max_ttl_s: .inf}\n",
    "- a\n",
    "? [a]\n: b\n",
    "x: !!python/object:os.system ls\n",
    "'\n",
    "\t\n",
    "workers: [{name: a, url: 'http://h:1', control: 'tcp://h:2'}]\n",
    "secret_file: /nonexistent\n",
    "%YAML 1.1\n---\n",
    "&a [*a]\n",
]


def yaml_text():
    """YAML documents: config-shaped fragments (anchors, aliases, deep
    nesting, tags) in any order, and odd text."""
    return st.one_of(
        st.lists(st.sampled_from(YAML_PARTS), max_size=6).map("".join),
        st.lists(st.one_of(st.sampled_from(YAML_PARTS), TEXT), max_size=5).map("".join),
    )


def _json_bytes(doc) -> bytes:
    try:
        return json.dumps(doc).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, OverflowError, RecursionError):
        return b"{}"


class _RouterUnderFuzz:
    """A real ``Router``'s app on a loopback port (aiohttp's test server), its
    Redis on a closed port and no worker started; ``post`` returns a status."""

    def __init__(self, tmp: Path, secret_file: Path):
        from aiohttp.test_utils import TestClient, TestServer

        from sessionkv.router.app import Router

        doc = router_doc(str(secret_file))
        doc["redis"] = {"url": "redis://127.0.0.1:9/0", "namespace": "fuzz", "timeout_s": 0.2}
        self._loop = asyncio.new_event_loop()

        async def start():
            router = Router(parse_config(doc))
            client = TestClient(TestServer(router.app, handler_cancellation=True))
            await client.start_server()
            return router, client

        self._router, self._client = self._loop.run_until_complete(start())

    def post(self, path: str, raw: bytes, headers: dict) -> int:
        async def go():
            async with self._client.post(path, data=raw, headers=headers) as r:
                await r.read()
                return r.status

        return self._loop.run_until_complete(go())

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.run_until_complete(self._router.store.close())
        self._loop.close()


def _pack(doc) -> bytes:
    try:
        return msgspec.msgpack.encode(doc)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
        return b""


def run_target(strategy, check, examples: int) -> dict:
    seen = {"examples": 0, "unexpected": 0, "first": None}

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(example):
        seen["examples"] += 1
        try:
            check(example)
        except Exception as e:  # anything the check did not expect
            seen["unexpected"] += 1
            if seen["first"] is None:
                seen["first"] = {"example": repr(example)[:500], "error": repr(e)[:500]}

    one()
    return seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--json", required=True)
    p.add_argument("--targets", help="a comma list (default: all)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table, (channel, client, http) = targets(Path(tmp))
        try:
            names = args.targets.split(",") if args.targets else list(table)
            out = {"examples": args.examples, "targets": {}}
            for name in names:
                t0 = time.monotonic()
                out["targets"][name] = r = run_target(*table[name], args.examples)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                print(
                    f"{name:16s} {r['examples']:7d} examples, {r['unexpected']} unexpected "
                    f"({r['wall_s']} s){'  first: ' + r['first']['error'] if r['first'] else ''}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            channel.close()
            client.close()
            http.close()
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["unexpected"] == 0 for r in out["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
