"""Hint copies reserve a bounded share of G2 at a time (waves), and a reset
does not wait for them. Real parts, built as ``SessionTierSpec`` builds them:
vLLM's CPU primary tier with ``SessionCachePolicy``, the index, the tier
manager and its Mover, over a real Redis G3 tier. The stalled backend is
real too: Redis's ``CLIENT PAUSE WRITE`` holds every write for a while."""

import select
import threading
import time
import uuid

import numpy as np
import pytest
import redis
from replay_router import make_hint
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from sessionkv.config import SessionKVConfig
from sessionkv.connectors.manager import SessionTierManager
from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.g2 import standalone_g2
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.devtools.keys import block_key
from sessionkv.engine.service import G3Copies
from sessionkv.events import EventLog, Outcome, Transfer
from sessionkv.hints import Action, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers import compat
from sessionkv.tiers.g3.backends.redis import RedisTier
from sessionkv.tiers.g3.tier import Quarantine
from sessionkv.types import Tier

CHUNKS, CHUNK = 16, 4096
WAVE = CHUNKS // 4  # limits.move_fraction's default: 25 % of G2
init_none_hash(sha256)  # what the engine does at start


@pytest.fixture
def parts(redis_url):
    index, quarantine, copies, events = SessionPrefixIndex(), Quarantine(), G3Copies(), EventLog()
    seen = []  # every G3 copy the tier made: (load, keys, ok)

    def observe(load, keys, ok):
        seen.append((load, list(keys), list(ok)))
        copies.observe(load, keys, ok)

    primary = standalone_g2(CHUNKS, CHUNK, index, quarantine, events)
    g3 = RedisTier(
        standalone_spec(str(MODELS / "tiny"), CHUNK),
        primary.get_kv_memoryview(),
        "redis",
        url=redis_url,
        namespace=f"waves-{uuid.uuid4().hex[:8]}",
        timeout_s=10.0,
        quarantine=quarantine,
        observer=observe,
    )
    m = SessionTierManager(primary, [g3], index, SessionKVConfig(), copies, events)
    yield m, g3, seen
    r = redis.Redis.from_url(redis_url)
    r.execute_command("CLIENT", "UNPAUSE")
    m.shutdown()


def fill(m, n, tag="k"):
    """``n`` chunks of session ``s`` stored in G2, each slot filled with its own bytes."""
    keys = [block_key(f"{tag}{i}") for i in range(n)]
    ctx = ReqContext(req_id=f"fill-{tag}")
    with m.lock:
        out = m.primary_tier.prepare_store(keys, ctx)
        g2 = np.frombuffer(m.primary_tier.get_kv_memoryview(), np.uint8).reshape(CHUNKS, CHUNK)
        for i, c in enumerate(out.store_spec.chunk_ids):
            g2[int(c)] = i + 1
        m.primary_tier.complete_store(keys, ctx)
        m.index.admit("s", keys, Tier.G2)
    return keys


def final(m, hint_id, timeout_s=30.0):
    """The hint's final outcomes and transfers from the event log, applying
    ended copies as the control channel would."""
    until = time.monotonic() + timeout_s
    while True:
        with m.lock:
            m.service.apply_moves()
        evs, _, _ = m.event_log.since(0, 100_000)
        outs = [
            e.outcome
            for e in evs
            if isinstance(e, Outcome)
            and e.outcome.hint_id == hint_id
            and e.outcome.status is not Status.DEFERRED
        ]
        if outs or time.monotonic() > until:
            return outs, [e for e in evs if isinstance(e, Transfer) and e.hint_id == hint_id]
        time.sleep(0.02)


def test_a_share_of_all_of_g2_leaves_vllm_chunks_to_evict_and_copies_in_waves(parts):
    # Issue "production scale": a Share reserved all its G2 chunks at once; with
    # every chunk named, vLLM's prepare_store found nothing to evict meanwhile.
    m, g3, seen = parts
    keys = fill(m, CHUNKS)  # G2 full, all of it shared
    (first,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    assert first.status is Status.DEFERRED, first
    ctx = ReqContext(req_id="vllm")
    with m.lock:  # before any wave ended
        out = m.primary_tier.prepare_store([block_key("new")], ctx)
        assert out is not None and len(out.evicted_keys) == 1, out
        m.primary_tier.complete_store([block_key("new")], ctx)
    (last,), (moved,) = final(m, first.hint_id)
    evicted = out.evicted_keys[0]
    assert (last.status, last.blocks_affected) == (Status.ACCEPTED, CHUNKS - 1), last
    assert sorted(moved.keys) == sorted(k for k in keys if k != evicted) and moved.ok
    waves = [ks for load, ks, _ in seen if not load]
    assert len(waves) == 4 and all(len(ks) <= WAVE for ks in waves), waves
    assert g3.listed(moved.keys) == [True] * (CHUNKS - 1)


def test_a_reset_gives_up_a_stalled_copy_and_keeps_its_slots_until_it_ends(parts, redis_url):
    # Issue "production scale": reset_cache held the lock across drain_jobs,
    # waiting for every hint copy in flight (minutes for a large one).
    m, g3, seen = parts
    fill(m, 8)
    r = redis.Redis.from_url(redis_url)
    r.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # the first wave's put stalls
    (first,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    assert first.status is Status.DEFERRED, first
    held = g3.quarantine.held
    assert len(held) == WAVE
    with m.lock:  # as the connector's reset_cache holds it
        m.reset_cache()
    assert seen == []  # returned while the copy stalls
    (gone,), _ = final(m, first.hint_id, timeout_s=0)
    assert (gone.status, gone.reason) == (Status.REJECTED, "G2 was reset"), gone
    ctx = ReqContext(req_id="after")
    with m.lock:  # the stalled copy's slots are not given to new KV
        new = [block_key(f"n{i}") for i in range(CHUNKS - WAVE)]
        out = m.primary_tier.prepare_store(new, ctx)
        assert not held & {int(c) for c in out.store_spec.chunk_ids}
        m.primary_tier.complete_store(new, ctx)
    r.execute_command("CLIENT", "UNPAUSE")
    g3.drain_hints()
    assert [ks for _, ks, _ in seen] and g3.quarantine.held == set()
    outs, _ = final(m, first.hint_id, timeout_s=0)
    assert outs == [gone]  # the late end changes nothing
    with m.lock:  # its slots are G2's again
        more = [block_key(f"m{i}") for i in range(WAVE)]
        out = m.primary_tier.prepare_store(more, ctx)
        assert {int(c) for c in out.store_spec.chunk_ids} == held


def test_a_share_asks_the_backend_again_before_answering_already_in_g3(parts, redis_url):
    # Issue 26: a Share answered "already in G3" from the index alone, for
    # objects the backend had evicted long ago. Now those chunks are asked for
    # in the wave's job; the ones gone are dropped from the index.
    m, g3, _ = parts
    keys = fill(m, 4)
    (first,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    (done,), _ = final(m, first.hint_id)
    assert done.status is Status.ACCEPTED and g3.listed(keys) == [True] * 4
    with m.lock:  # G2 forgets them; G3 still has them
        m.reset_cache()
    assert [m.index.copies(k)[Tier.G3] for k in keys] == [1] * 4
    redis.Redis.from_url(redis_url).delete(*g3.objects(keys[2]), *g3.objects(keys[3]))
    (again,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    (last,), (named,) = final(m, again.hint_id)
    assert (last.status, last.reason, last.blocks_affected) == (
        Status.ACCEPTED,
        "already in G3",
        2,
    ), last
    assert named.keys == [] and named.already == keys[:2]
    assert keys[2] not in m.index and keys[3] not in m.index


def test_the_lock_is_never_taken_twice(parts):
    # A plain Lock, as vLLM 0.33's tiering manager has: the scheduler-side
    # methods run under the caller's hold without taking it again (each would
    # hang here if it did), and a second acquire by the holder fails.
    m, _, _ = parts
    done = []

    def pass_():
        with m.lock:
            assert not m.lock.acquire(timeout=0.05)
            m.service.apply_moves()
            m.service.expire_sessions(time.monotonic(), 10)
            m.service.collect_clipped()
            m.get_stats()
            m.reset_cache()
            done.append(True)

    t = threading.Thread(target=pass_, daemon=True)
    t.start()
    t.join(30)
    assert done == [True], "a scheduler-side method took the lock again"
    assert m.service.end_session("nobody") is False  # out of band: takes it itself


def test_the_scheduler_finishes_copies_without_a_system_call(parts, monkeypatch):
    # CI: an engine stepping while its request waited for a G3 load called
    # os.read on the wake pipe every pass; that loop of short GIL releases
    # kept the disk tier's reads from the GIL for 5-10 s a load, past their
    # deadline (a miss and a recompute). The pipe is the control thread's.
    from sessionkv import events

    m, g3, _ = parts
    keys = fill(m, 4)

    def no_read(*args):
        raise AssertionError("apply read the wake pipe")

    monkeypatch.setattr(events.os, "read", no_read)
    (first,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    (done,), _ = final(m, first.hint_id)
    assert done.status is Status.ACCEPTED and g3.listed(keys) == [True] * 4
    monkeypatch.undo()
    wake = m.service.wake.fd
    assert select.select([wake], [], [], 0)[0] == [wake]  # left for the control thread
    m.service.wake.drain()
    assert select.select([wake], [], [], 0)[0] == []


def test_no_hint_load_writes_g2_between_a_reset_and_the_flush(parts):
    # Issue 52: after reset_cache, vLLM 0.33 holds its promotions until
    # on_reset_flushed (a worker may still write a slot the reset freed, for a
    # job in flight); a Prefetch reserved G2 and wrote G3 bytes into those
    # slots meanwhile. Now the Mover holds its loads over the same window.
    # vLLM 0.32 has no fence (engine/mover.py, "Reset fence").
    m, g3, seen = parts
    keys = fill(m, 4)
    (share,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    (done,), _ = final(m, share.hint_id)
    assert done.status is Status.ACCEPTED and g3.listed(keys) == [True] * 4
    with m.lock:
        m.reset_cache()  # vLLM's connector scheduler: jobs were in flight
    seen.clear()
    (first,) = m.service.control_hints([make_hint(Action.PREFETCH, "s")], "s", "r")
    assert first.status is Status.DEFERRED, first
    ctx = ReqContext(req_id="probe")
    if compat.VLLM_FENCES_RESETS:
        outs, _ = final(m, first.hint_id, timeout_s=0.5)
        assert outs == [] and seen == [], "a hint load ran before the workers flushed"
        with m.lock:
            assert [m.primary_tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 4
            m.on_reset_flushed()  # the workers reported every flushed job
    (last,), (moved,) = final(m, first.hint_id)
    assert last.status is Status.ACCEPTED, last
    assert [load for load, _, _ in seen] == [True] and sorted(moved.keys) == sorted(keys)
    with m.lock:
        assert [m.primary_tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4


def test_one_hold_of_the_lock_reserves_at_most_a_slice(parts, monkeypatch):
    # Issue 52: one wave reserved up to 25 % of G2 in one prepare_write under
    # the step lock (92 ms for 16,384 chunks). Now each hold takes at most
    # SLICE_CHUNKS, and the Mover wakes its reader to go on while idle.
    from sessionkv.engine import mover as moves

    m, g3, seen = parts
    monkeypatch.setattr(moves, "SLICE_CHUNKS", 3)
    keys = fill(m, CHUNKS)
    (first,) = m.service.control_hints([make_hint(Action.SHARE, "s", destination="self")], "s", "r")
    assert first.status is Status.DEFERRED
    assert [len(ks) for _, ks, _ in seen] in ([], [3])  # the first hold's one slice
    (last,), (moved,) = final(m, first.hint_id)
    assert last.status is Status.ACCEPTED and sorted(moved.keys) == sorted(keys)
    assert [len(ks) for _, ks, _ in seen] == [3, 3, 3, 3, 3, 1]
    seen.clear()
    (pin,) = m.service.control_hints([make_hint(Action.PIN, "s", ttl_s=60)], "s", "r")
    (done,), _ = final(m, pin.hint_id)
    # G2's pin quota (a quarter of G2) clips the G2 side; G3 pins all, a slice a hold
    assert done.blocks_affected == CHUNKS, done
