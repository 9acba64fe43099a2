"""router.yaml parsing, the routing rule, and session state on a real Redis."""

import asyncio
import re
import uuid
from dataclasses import dataclass

import pytest

from sessionkv.hints import HintOutcome, Status
from sessionkv.router import parse_config
from sessionkv.router.config import RedisConfig, load_config
from sessionkv.router.hinting import ends_in_tool_call, tool_gap_from_header
from sessionkv.router.metrics import Counters
from sessionkv.router.routing import NoWorker, choose
from sessionkv.router.state import SessionStore


@pytest.fixture
def doc(tmp_path):
    (tmp_path / "key").write_bytes(b"k" * 32)
    return {
        "secret_file": str(tmp_path / "key"),
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "workers": [
            {"name": "a", "url": "http://127.0.0.1:1/", "control": "tcp://x:1"},
            {"name": "b", "url": "http://127.0.0.1:2", "endpoint_file": "/b.json"},
        ],
    }


def test_defaults_and_overrides(doc):
    cfg = parse_config(doc)
    assert cfg.workers[0].url == "http://127.0.0.1:1" and cfg.workers[1].endpoint_file == "/b.json"
    assert (cfg.host, cfg.port, cfg.routing.max_load, cfg.policy.on_end, cfg.policy.on_move) == (
        "127.0.0.1",
        8100,
        4,
        "free",
        "share",
    )
    assert cfg.policy.tool_call.expected_gap_s == 60 and not cfg.policy.warmup.enabled
    cfg = parse_config(
        {
            **doc,
            "policy": {
                "on_move": "share_prefetch",
                "tool_call": {"pin": False},
                "warmup": {"lead_s": 1},
            },
        }
    )
    assert (cfg.policy.on_move, cfg.policy.tool_call.pin, cfg.policy.warmup.lead_s) == (
        "share_prefetch",
        False,
        1,
    )
    assert cfg.policy.tool_call.pin_ttl_factor == 1.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"secret_file": None}, "secret_file"),
        ({"redis": {}}, "redis.url is required"),
        ({"workers": []}, "workers must be a non-empty list"),
        ({"routing": {"max_load": 0}}, "routing.max_load must be a positive integer"),
        ({"routing": {"maxload": 3}}, "routing.maxload: unknown key"),
        ({"policy": {"on_end": "delete"}}, "policy.on_end must be one of"),
        ({"policy": {"tool_call": {"pin": "yes"}}}, "policy.tool_call.pin must be true or false"),
        ({"policy": {"warmup": {"lead": 1}}}, "policy.warmup.lead: unknown key"),
        ({"listen": {"port": 70000}}, "listen.port"),
        ({"listen": {"header_timeout_s": 0}}, "listen.header_timeout_s must be a positive number"),
        ({"listen": {"body_timeout": 5}}, "listen.body_timeout: unknown key"),
        ({"version": 2}, "version must be 1"),
        ({"bogus": 1}, "router config.bogus: unknown key"),
        ({"version": True}, "version must be 1"),  # True == 1 passed
        (
            {"redis": {"url": "redis://x", "state_ttl_s": 0.5}},
            "redis.state_ttl_s must be at least 1",
        ),
        (
            {"policy": {"tool_call": {"expected_gap_s": float("inf")}}},  # a Pin TTL of inf: a 500
            "policy.tool_call.expected_gap_s must be a positive number",
        ),
        ({"routing": {"load_poll_s": float("nan")}}, "routing.load_poll_s"),
        (
            {"workers": [{"name": "a\x00", "url": "http://h:1", "control": "tcp://h:2"}]},
            "workers[0].name must not hold control characters",
        ),
    ],
)
def test_errors_name_the_key(doc, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config({**doc, **change})


def test_yaml_aliases_are_refused(tmp_path):
    path = tmp_path / "router.yaml"  # a "billion laughs": 350 bytes took 3 GiB, 50 s
    path.write_text(
        "version: 1\n"
        + "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, n in zip("abcde", "bcdef")
        )
    )
    with pytest.raises(ValueError, match="aliases"):
        load_config(str(path))


def test_deep_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("version: 1\nworkers: " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(ValueError, match="nested too deep"):  # was a RecursionError
        load_config(str(path))


def test_worker_errors(doc):
    w = dict(doc["workers"][0])
    for bad, message in [
        ({**w, "url": "127.0.0.1:1"}, "url must be an http"),
        ({**w, "endpoint_file": "/a"}, "one of them"),
        ({"name": "a", "url": "http://x"}, "one of them"),
        ({"url": "http://x", "control": "tcp://x:1"}, "name is required"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config({**doc, "workers": [bad]})
    with pytest.raises(ValueError, match="names must be unique"):
        parse_config({**doc, "workers": [w, w]})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        open(doc["secret_file"], "wb").write(b"short")
        parse_config(doc)


@dataclass
class W:
    name: str
    load: float
    healthy: bool = True
    draining: bool = False


def test_affinity_first_then_load():
    a, b, c = W("a", 1), W("b", 0), W("c", 5)
    assert choose([a, b, c], "a", 4) == "a"  # under max_load: stays
    a.load = 4
    assert choose([a, b, c], "a", 4) == "b"  # overloaded, b is lighter
    b.load = 4
    assert choose([a, b, c], "a", 4) == "a"  # nobody under max_load: stays
    b.load, a.healthy = 2, False
    assert choose([a, b, c], "a", 4) == "b"  # its worker is down
    assert choose([W("a", 0), W("b", 0)], None, 4, 0) == "a"
    assert choose([W("a", 0), W("b", 0)], None, 4, 1) == "b"  # ties go round
    with pytest.raises(NoWorker):
        choose([W("a", 0, False)], None, 4)


def test_a_draining_worker_takes_turns_only_when_no_other_can():
    a, b = W("a", 0, draining=True), W("b", 3)
    assert choose([a, b], "a", 4) == "b"  # its sessions move
    assert choose([a, b], None, 4) == "b"  # new ones go elsewhere
    b.healthy = False
    assert choose([a, b], "a", 4) == "a"  # the only one left: still served


def test_tool_calls_and_counters(doc):
    policy = parse_config(doc).policy
    assert tool_gap_from_header(None, policy) is None
    assert (
        tool_gap_from_header("default", policy) == 60 and tool_gap_from_header("2.5", policy) == 2.5
    )
    with pytest.raises(ValueError):
        tool_gap_from_header("-1", policy)
    assert ends_in_tool_call({"choices": [{"finish_reason": "tool_calls"}]})
    assert ends_in_tool_call({"choices": [{"message": {"tool_calls": [{"id": "x"}]}}]})
    assert not ends_in_tool_call({"choices": [{"finish_reason": "stop", "message": {}}]})
    c = Counters()
    c.outcome(HintOutcome("p", "kv.pin", Status.ACCEPTED), "request")
    c.outcome(HintOutcome("p", "kv.pin", Status.ACCEPTED), "request")
    c.outcome(HintOutcome("e", "end_session", Status.ACCEPTED), "control")
    assert c.to_dict()["outcomes"] == {
        "pin": {"request": {"accepted": 2}},
        "end_session": {"control": {"accepted": 1}},
    }


def test_session_store_on_redis(redis_url):
    async def go():
        store = SessionStore(RedisConfig(redis_url, namespace=f"t-{uuid.uuid4().hex[:6]}"))
        other = SessionStore(RedisConfig(redis_url, namespace=store._ns))  # a second replica
        try:
            assert await store.get("s") is None
            assert await store.claim("s", "a") == "a"
            assert await other.claim("s", "b") == "a"  # first placement wins
            await store.turn_started("s")
            await store.turn_started("s")
            st = await other.get("s")
            assert (st.worker, st.turns, st.gap_until) == ("a", 2, 0)
            assert await other.move("s", "a", "b") and not await store.move("s", "a", "c")
            assert (await store.get("s")).worker == "b"
            await store.turn_ended("s", 30.0)
            assert (await store.get("s")).gap_until > 0
            assert await store.idle(1.0) == []  # in its tool gap
            assert await store.idle(-60.0) == ["s"]
            assert (await store.end("s")).worker == "b"
            assert await other.end("s") is None  # ended once
            assert await store.get("s") is None
            assert await store.round_robin() + 1 == await other.round_robin()
        finally:
            await store.close()
            await other.close()

    asyncio.run(go())


def test_routing_affinity_then_overlap_then_load():
    a, b, c = W("a", 2), W("b", 0), W("c", 1)
    # a new session: most overlap wins over load, among workers under max_load
    assert choose([a, b, c], None, 4, scores={"a": 3, "b": 0, "c": 1}) == "a"
    assert choose([a, b, c], None, 4, scores={"a": 0, "b": 0, "c": 0}) == "b"
    assert choose([a, b, c], None, 4) == "b"
    assert choose([a, b, c], None, 4, scores={"a": 2, "c": 2}) == "c"  # tie: less load
    # affinity before overlap
    assert choose([a, b, c], "c", 4, scores={"a": 9}) == "c"
    # a full worker takes no new session, however much it holds
    a.load = 4
    assert choose([a, b, c], None, 4, scores={"a": 9, "c": 1}) == "c"
    # a dead worker's session goes where its prefix is
    c.healthy = False
    assert choose([a, b, c], "c", 4, scores={"b": 1}) == "b"


def test_pin_quota_counts_sessions_per_client_until_their_pins_end():
    from sessionkv.router.hinting import PinQuota

    now = [0.0]
    q = PinQuota(per_client=2, max_clients=3, clock=lambda: now[0])
    assert q.take("a", "s1", 10) and q.take("a", "s2", 10)
    assert not q.take("a", "s3", 10)  # a third session of a's: over quota
    assert q.take("a", "s1", 10)  # a session it holds: renewed
    assert q.take("b", "s3", 10)  # another client's quota is its own
    now[0] = 10.5
    assert q.take("a", "s3", 10)  # a's Pins of s1 and s2 ended at 10
    now[0] = 0
    for c in "cdef":
        q.take(c, "x", 10)
    assert len(q._pins) == 3  # bounded: least recently pinning first out
