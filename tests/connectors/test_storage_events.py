"""vLLM's KV events (``BlockStored`` / ``BlockRemoved`` with a medium: what
llm-d's indexer and Dynamo's router consume) tell the truth about G3 and
about hint copies. Real parts, built as ``SessionTierSpec`` builds them with
KV events on: vLLM's CPU primary tier with ``SessionCachePolicy``, the tier
manager and its Mover, real G3 tiers (a directory, a Redis server), and
vLLM's own events tracker (``SessionEventsTracker``) translating what the
manager's ``take_events`` yields, as vLLM's connector scheduler does.

Issue 52, "KV events that lie": G3 ``BlockStored`` was never followed by
``BlockRemoved``; Demote and Share wrote G3 with no event; a chunk several
sessions use was tagged with the session that stored it first."""

import os
import time
import types
import uuid

import numpy as np
import pytest
import redis
from replay_router import make_hint
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    get_offload_block_hash,
)
from vllm.v1.request import Request

from sessionkv.config import SessionKVConfig
from sessionkv.connectors.kv_events import SessionEventsTracker
from sessionkv.connectors.manager import SessionTierManager
from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.g2 import standalone_g2
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.devtools.keys import block_key
from sessionkv.engine.service import G3Copies
from sessionkv.events import EventLog, Outcome
from sessionkv.hints import Action, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g3.backends.disk import DiskBackend, DiskTier
from sessionkv.tiers.g3.backends.redis import RedisTier
from sessionkv.tiers.g3.tier import Quarantine
from sessionkv.types import Tier

CHUNKS, CHUNK = 16, 4096
G2, G3 = "CPU", "STORAGE"  # the media vLLM's events name
init_none_hash(sha256)  # what the engine does at start


class Stack:
    """G2, one G3 tier, the manager and vLLM's events tracker, events on."""

    def __init__(self, make_g3):
        index, quarantine, copies = SessionPrefixIndex(), Quarantine(), G3Copies()
        self.log = EventLog()
        self.g2 = standalone_g2(CHUNKS, CHUNK, index, quarantine, self.log, enable_events=True)
        spec = standalone_spec(str(MODELS / "tiny"), CHUNK)
        spec.kv_events_config = types.SimpleNamespace(enable_kv_cache_events=True)
        self.g3 = make_g3(spec, self.g2.get_kv_memoryview(), quarantine, copies.observe)
        self.m = SessionTierManager(self.g2, [self.g3], index, SessionKVConfig(), copies, self.log)
        self.tracker = SessionEventsTracker.replacing(
            OffloadingEventsTracker(OffloadingKVEventsConfig(True, False)), 2 * CHUNKS
        )

    def fill(self, n, tag="k"):
        """``n`` chunks of session ``s`` stored in G2 (no cascade), each its own bytes."""
        keys = [block_key(f"{tag}{i}") for i in range(n)]
        ctx = ReqContext(req_id=f"fill-{tag}")
        with self.m.lock:
            out = self.g2.prepare_store(keys, ctx)
            view = np.frombuffer(self.g2.get_kv_memoryview(), np.uint8).reshape(CHUNKS, CHUNK)
            for i, c in enumerate(out.store_spec.chunk_ids):
                view[int(c)] = i + 1
            self.g2.complete_store(keys, ctx)
            self.m.index.admit("s", keys, Tier.G2)
        return keys

    def cascade(self, n, tag="c"):
        """``n`` chunks stored in G2 as vLLM stores a request's, which vLLM's
        tiering manager cascades to G3 (``g3.write_through``); G3's events."""
        keys = [block_key(f"{tag}{i}") for i in range(n)]
        ctx = ReqContext(req_id=f"req-{tag}")
        with self.m.lock:
            self.m.on_new_request(ctx)
            self.m.prepare_store(keys, ctx)
            self.m.complete_store(keys, ctx)
            self.m.on_schedule_end(
                ScheduleEndContext(new_req_ids=(ctx.req_id,), preempted_req_ids=())
            )
            self.m.on_request_finished(ctx)
        until, evs = time.monotonic() + 30, []
        while named(evs, BlockStored, G3) != hashes(keys):
            assert time.monotonic() < until, evs
            time.sleep(0.02)
            with self.m.lock:
                self.m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            evs += self.events()
        return keys

    def hint(self, action, **kw):
        """Run one hint from the control channel to its final outcome."""
        (first,) = self.m.service.control_hints([make_hint(action, "s", **kw)], "s", "r")
        until = time.monotonic() + 30
        while time.monotonic() < until:
            with self.m.lock:
                self.m.service.apply_moves()
            evs, _, _ = self.log.since(0, 100_000)
            done = [
                e.outcome
                for e in evs
                if isinstance(e, Outcome)
                and e.outcome.hint_id == first.hint_id
                and e.outcome.status is not Status.DEFERRED
            ]
            if done:
                return done[0]
            time.sleep(0.02)
        raise AssertionError(f"{action} never ended")

    def events(self):
        """vLLM's KV events since the last call (the scheduler's take_events)."""
        with self.m.lock:
            return list(self.tracker.take_events(self.m.take_events()))

    def close(self):
        self.m.shutdown()


def hashes(keys):
    """The block hashes vLLM's events name for these (one-block) chunks."""
    return {maybe_convert_block_hash(get_offload_block_hash(k)) for k in keys}


def named(events, kind, medium):
    return {h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes}


def disk(where, max_bytes=1 << 24):
    def make(spec, view, quarantine, observe):
        return DiskTier(
            spec,
            view,
            "disk",
            path=str(where),
            max_bytes=max_bytes,
            namespace=f"ev-{uuid.uuid4().hex[:8]}",
            timeout_s=10.0,
            quarantine=quarantine,
            observer=observe,
        )

    return make


@pytest.fixture
def stack(tmp_path):
    s = Stack(disk(tmp_path / "g3"))
    yield s
    s.close()


@pytest.mark.parametrize("action", [Action.SHARE, Action.DEMOTE])
def test_a_hint_copy_to_g3_announces_its_chunks_stored_in_g3(stack, action):
    # Demote and Share write G3 outside vLLM's job table: they emitted no event.
    keys = stack.fill(4)
    stack.events()  # G2's own stores
    assert stack.hint(action).status is Status.ACCEPTED
    evs = stack.events()
    assert named(evs, BlockStored, G3) == hashes(keys), evs
    assert all(e.locality == "LOCAL" for e in evs if isinstance(e, BlockStored))
    assert stack.hint(action).status is Status.ACCEPTED  # in G3 already: no second store
    assert named(stack.events(), BlockStored, G3) == set()


def test_a_prefetch_into_g2_announces_its_chunks_stored_in_g2(stack):
    # A Prefetch (and kv.fetch) fills G2 through vLLM's own complete_store.
    keys = stack.fill(4)
    assert stack.hint(Action.SHARE).status is Status.ACCEPTED
    stack.fill(CHUNKS, "other")  # G2 evicts them
    stack.events()
    assert stack.hint(Action.PREFETCH, keys=keys).status is Status.ACCEPTED
    evs = stack.events()
    assert named(evs, BlockStored, G2) == hashes(keys), evs
    assert named(evs, BlockStored, G3) == set()


def test_a_lookup_that_finds_an_announced_chunk_gone_removes_it(stack, tmp_path):
    keys = stack.cascade(4)  # announced by vLLM's cascade
    # Another engine on the directory removes two objects (its eviction).
    other = DiskBackend(str(tmp_path / "g3"), 1 << 24)
    assert other.remove([stack.g3.name(k) for k in keys[:2]]) == [True, True]
    other.close()
    never = block_key("never-stored")
    # What vLLM's lookups (and a hint copy's check) ask.
    assert stack.g3.listed([*keys, never]) == [False, False, True, True, False]
    evs = stack.events()
    assert named(evs, BlockRemoved, G3) == hashes(keys[:2]), evs
    assert stack.g3.listed(keys[:2]) == [False, False]  # said once
    assert stack.events() == []


def test_a_load_that_finds_an_announced_chunk_unreadable_removes_it(stack, tmp_path):
    keys = stack.cascade(4)
    stack.fill(CHUNKS, "other")  # G2 evicts them
    stack.events()
    path = stack.g3._backend.path_of(stack.g3.name(keys[0]))
    with open(path, "r+b") as f:  # torn: fails its checksum
        f.seek(10)
        f.write(b"\xff\xfe")
    out = stack.hint(Action.PREFETCH, keys=keys)
    assert out.status is Status.CLIPPED, out
    evs = stack.events()
    assert named(evs, BlockRemoved, G3) == hashes(keys[:1]), evs
    assert named(evs, BlockStored, G2) == hashes(keys[1:]), evs
    assert not os.path.exists(path)  # unlisted


def test_the_disk_tiers_own_eviction_removes_what_it_evicted(tmp_path):
    # Room for 10 objects: the 10th put passes HIGH_WATER and wakes the
    # evictor, which removes the least recently used down to LOW_WATER.
    s = Stack(disk(tmp_path / "g3", max_bytes=10 * (CHUNK + 16)))
    try:
        keys = s.fill(CHUNKS)
        assert s.hint(Action.SHARE).status in (Status.ACCEPTED, Status.CLIPPED)
        other = DiskBackend(str(tmp_path / "g3"), 1 << 24)
        names = [s.g3.name(k) for k in keys]
        until, removed, stored = time.monotonic() + 20, set(), set()
        while True:
            evs = s.events()
            stored |= named(evs, BlockStored, G3)
            removed |= named(evs, BlockRemoved, G3)
            gone = {
                h
                for h, there in zip(hashes_list(keys), other.exists(names))
                if not there and h in stored
            }
            if removed and removed == gone:
                break
            assert time.monotonic() < until, (removed, gone)
            time.sleep(0.05)
        other.close()
        assert removed <= stored and 0 < len(removed) < len(stored)
    finally:
        s.close()


def hashes_list(keys):
    return [maybe_convert_block_hash(get_offload_block_hash(k)) for k in keys]


def test_a_redis_ttl_lapse_removes_what_it_lapsed_and_a_pin_holds_it(redis_url):
    def make(spec, view, quarantine, observe):
        return RedisTier(
            spec,
            view,
            "redis",
            url=redis_url,
            ttl_s=1,
            namespace=f"ev-{uuid.uuid4().hex[:8]}",
            timeout_s=10.0,
            quarantine=quarantine,
            observer=observe,
        )

    s = Stack(make)
    try:
        keys = s.cascade(4)
        pinned = []
        s.g3.pin(keys[:1], 30.0, None, pinned.append)
        until = time.monotonic() + 10
        while not pinned:
            assert time.monotonic() < until
            time.sleep(0.01)
        assert pinned == [[True]]
        r = redis.Redis.from_url(redis_url)
        names = [s.g3.name(k) for k in keys]
        while any(r.exists(n) for n in names[1:]):  # the server lapses them
            assert time.monotonic() < until
            time.sleep(0.05)
        time.sleep(0.2)
        evs = s.events()
        assert named(evs, BlockRemoved, G3) == hashes(keys[1:]), evs
        assert r.exists(names[0])  # pinned: still there
    finally:
        s.close()


def test_announced_g3_chunks_are_bounded_and_the_oldest_retired_as_removed(stack):
    # At most 2 x G2 chunks are vouched for; past it the oldest is retired.
    first = stack.fill(CHUNKS, "a")
    assert stack.hint(Action.SHARE).status is Status.ACCEPTED
    second = stack.fill(CHUNKS, "b")
    assert stack.hint(Action.SHARE).status is Status.ACCEPTED
    assert named(stack.events(), BlockRemoved, G3) == set()
    third = stack.fill(4, "c")
    assert stack.hint(Action.SHARE, keys=third).status is Status.ACCEPTED
    evs = stack.events()
    assert named(evs, BlockStored, G3) == hashes(third)
    assert named(evs, BlockRemoved, G3) == hashes(first[:4]), evs
    assert stack.g3.listed(first[:4]) == [True] * 4  # there, no longer vouched for
    assert stack.events() == []  # and not removed twice
    assert second


def request(rid, session):
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), None, session_id=session)


def tags(tracker, keys):
    """The session_id vLLM's event for each chunk's G3 store carries."""
    evs = list(
        tracker.take_events(
            [OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=False)]
        )
    )
    return [e.session_id for e in evs]


def test_a_chunk_several_sessions_use_names_none_of_them():
    # The first session to store a chunk was named on every later event of it.
    tracker = SessionEventsTracker.replacing(
        OffloadingEventsTracker(OffloadingKVEventsConfig(True, False)), 64
    )
    alone, shared, anon, turns = (block_key(n) for n in ("alone", "shared", "anon", "turns"))
    a1, a2, b, none = request("a1", "A"), request("a2", "A"), request("b", "B"), request("n", None)
    tracker.record_store(a1, None, 0, alone)
    tracker.record_store(a1, None, 1, shared)
    tracker.record_lookup(b, None, 1, shared)  # B reuses it from G2
    tracker.record_store(a1, None, 2, anon)
    tracker.record_lookup(none, None, 2, anon)  # so does a request of no session
    tracker.record_store(a1, None, 3, turns)
    tracker.record_lookup(a2, None, 3, turns)  # A's next turn: still A's alone
    assert tags(tracker, [alone, shared, anon, turns]) == ["A", None, None, "A"]
    tracker.record_store(a2, None, 1, shared)  # stored again: still shared
    assert tags(tracker, [shared]) == [None]
