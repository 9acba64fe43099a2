"""The contract every G3 tier passes (Mooncake, Redis, LMCache, the disk and the
in-memory reference: a backend joins by adding itself to ``BACKENDS``), on
the real backend service.

A tier is driven the way vLLM's tiering manager drives it: ``submit_store``
from G2 slots, ``lookup``, ``submit_load`` into other G2 slots (poisoned
first, so a load that wrote nothing fails), ``get_finished_jobs``,
``drain_jobs``.
"""

import threading
import time
import tracemalloc
import uuid
import weakref

import numpy as np
import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.devtools.keys import block_key
from sessionkv.keys import G3_MAC, derive
from sessionkv.tiers.g3 import layout as g3_layout
from sessionkv.tiers.g3 import tier as g3
from sessionkv.tiers.g3.backend import SUM
from sessionkv.tiers.g3.tier import SUM_SUFFIX, checksum

CHUNK = 4096
N_CHUNKS = 16
init_none_hash(sha256)  # what the engine does at start


def spec(model=str(MODELS / "tiny"), block_size=32, dtype="float32", chunk=CHUNK):
    return standalone_spec(model, chunk, block_size, dtype)


class Mooncake:
    """Mooncake Store: the session's master and store process; for faults,
    its own, and the master is what fails."""

    @staticmethod
    def shared(request):
        return request.getfixturevalue("mooncake")

    @staticmethod
    def own(log_dir):
        from sessionkv.devtools.services import start_mooncake

        ports, master, store = start_mooncake(log_dir)
        return ports, master, [store, master]

    @staticmethod
    def tier(ports, spec_, view, namespace, **kw):
        from sessionkv.devtools.services import lan_address
        from sessionkv.tiers.g3.backends.mooncake import MooncakeTier

        return MooncakeTier(
            spec_,
            view,
            "mooncake",
            master=ports.master,
            metadata_server=ports.metadata_url,
            local_hostname=lan_address(),
            namespace=namespace,
            **kw,
        )


class Redis:
    """Redis: the session's server; for faults, its own."""

    @staticmethod
    def shared(request):
        return request.getfixturevalue("redis_url")

    @staticmethod
    def own(log_dir):
        from sessionkv.devtools.services import start_redis

        url, server = start_redis(log_dir)
        return url, server, [server]

    @staticmethod
    def tier(url, spec_, view, namespace, **kw):
        from sessionkv.tiers.g3.backends.redis import RedisTier

        return RedisTier(spec_, view, "redis", url=url, namespace=namespace, **kw)


class LMCache:
    """LMCache's lm:// server: the session's server; for faults, its own."""

    @staticmethod
    def shared(request):
        return request.getfixturevalue("lmcache_url")

    @staticmethod
    def own(log_dir):
        from sessionkv.devtools.services import start_lmcache

        url, server = start_lmcache(log_dir)
        return url, server, [server]

    @staticmethod
    def tier(url, spec_, view, namespace, **kw):
        from sessionkv.tiers.g3.backends.lmcache import LMCacheTier

        return LMCacheTier(spec_, view, "lmcache", url=url, namespace=namespace, **kw)


class Stall:
    """FAKE fault, for the disk and the in-memory backend only (they have no
    process to stop): a filesystem that stops answering (an
    NFS mount whose server went away), which a local directory cannot be
    made to do on cue. ``signal(SIGSTOP)`` makes every backend call wait
    until ``signal(SIGCONT)``, as a stopped service process does."""

    def __init__(self):
        self.running = threading.Event()
        self.running.set()

    def signal(self, sig):
        import signal

        (self.running.clear if sig == signal.SIGSTOP else self.running.set)()


class Disk:
    """The local-disk tier (``tiers/g3/backends/disk.py``): one directory for the
    session's tests (namespaces keep them apart); for faults, its own
    directory behind a ``Stall``."""

    MAX_BYTES = 1 << 30

    @staticmethod
    def shared(request):
        return request.getfixturevalue("g3_disk")

    @staticmethod
    def own(log_dir):
        return (str(log_dir / "g3-disk"), Stall()), None, []

    @classmethod
    def tier(cls, where, spec_, view, namespace, **kw):
        from sessionkv.tiers.g3.backends.disk import DiskBackend, DiskTier

        if isinstance(where, tuple):
            path, stall = where
            backend = _stalled(DiskBackend(path, cls.MAX_BYTES), stall)
            return DiskTier(spec_, view, "disk", backend=backend, namespace=namespace, **kw)
        return DiskTier(
            spec_, view, "disk", path=where, max_bytes=cls.MAX_BYTES, namespace=namespace, **kw
        )


def _stalled(backend, stall):
    """``backend`` whose calls wait while ``stall`` is stopped."""
    for name in (
        "exists",
        "put_summed",
        "get_summed",
        "put_chunks",
        "get_chunks",
        "put_small",
        "get_small",
        "remove",
        "pin",
    ):

        def call(*a, _fn=getattr(backend, name), **kw):
            stall.running.wait()
            return _fn(*a, **kw)

        setattr(backend, name, call)
    return backend


class Memory:
    """The in-memory reference backend (``tiers/g3/backends/memory.py``): one
    store for the session's tests (namespaces keep them apart); for faults,
    its own behind a ``Stall``."""

    SHARED = None

    @classmethod
    def shared(cls, request):
        from sessionkv.tiers.g3.backends.memory import MemoryBackend

        if cls.SHARED is None:
            cls.SHARED = MemoryBackend(1 << 30)
        return cls.SHARED

    @staticmethod
    def own(log_dir):
        from sessionkv.tiers.g3.backends.memory import MemoryBackend

        return (MemoryBackend(1 << 30), Stall()), None, []

    @staticmethod
    def tier(where, spec_, view, namespace, **kw):
        from sessionkv.tiers.g3.backends.memory import MemoryTier

        backend = _stalled(*where) if isinstance(where, tuple) else where
        return MemoryTier(spec_, view, "memory", backend=backend, namespace=namespace, **kw)


BACKENDS = {
    "mooncake": Mooncake,
    "redis": Redis,
    "lmcache": LMCache,
    "disk": Disk,
    "memory": Memory,
}


@pytest.fixture(params=sorted(BACKENDS))
def make(request):
    """Builds tiers on one backend's shared service; each test gets its own
    namespace, so tests never see each other's objects."""
    backend = BACKENDS[request.param]
    where = backend.shared(request)
    namespace = f"contract-{uuid.uuid4().hex[:8]}"
    made = []

    def build(spec_=None, namespace_=namespace, chunk=CHUNK, **kw):
        region = np.zeros((N_CHUNKS, chunk), np.uint8)
        tier = backend.tier(
            where, spec_ or spec(chunk=chunk), memoryview(region), namespace_, timeout_s=5.0, **kw
        )
        made.append(tier)
        return tier, region

    yield build
    for t in made:
        t.shutdown()


@pytest.fixture(params=sorted(BACKENDS))
def faulty(request, tmp_path):
    """A tier on its own backend service, and the process to fail."""
    backend = BACKENDS[request.param]
    where, victim, services = backend.own(tmp_path)
    tier = backend.tier(
        where,
        spec(),
        memoryview(np.zeros((N_CHUNKS, CHUNK), np.uint8)),
        "faults",
        timeout_s=0.5,
        retry_s=0.3,
    )
    yield tier, victim if victim is not None else where[1]
    tier.shutdown()
    for s in services:
        s.stop()


KEYS = [block_key(i) for i in range(1, 9)]
_jobs = iter(range(1, 1 << 30))


def look(tier, key):
    """A lookup as vLLM makes it: RETRY until the asynchronous answer is in
    (the scheduler flushes the batch at the end of each step)."""
    ctx = ReqContext(req_id=f"look-{next(_jobs)}")
    try:
        for _ in range(500):
            r = tier.lookup(key, ctx)
            if r is not LookupResult.RETRY:
                return r
            tier.on_schedule_end(None)
            time.sleep(0.01)
        raise AssertionError("lookup never resolved")
    finally:
        tier.on_request_finished(ctx)


def job(keys, slots, promotion):
    return TransferJob(
        next(_jobs), list(keys), np.asarray(slots, np.int64), promotion, ReqContext(req_id="r")
    )


def run(tier, keys, slots, promotion):
    j = job(keys, slots, promotion)
    (tier.submit_load if promotion else tier.submit_store)(j)
    tier.drain_jobs()
    (result,) = [r for r in tier.get_finished_jobs() if r.job_id == j.job_id]
    return result


def plant(tier, key, data, like):
    """Replace ``key``'s object(s) by ``data`` with the checksum of ``like``,
    as the tier would have written them."""
    assert tier._backend.remove(tier.objects(key)) == [True] * len(tier.objects(key))
    seed(tier, key, data, like)


SUM_BUFFERS: "weakref.WeakKeyDictionary[object, np.ndarray]" = weakref.WeakKeyDictionary()


def seed(tier, key, data, like=None):
    """Write ``key``'s object(s) where there were none: ``data`` with the
    (unkeyed) checksum of ``like`` (default: of ``data``), as a writer with
    store access but no key would."""
    b, name = tier._backend, tier.name(key)
    sum_bytes = checksum(data if like is None else like)
    if b.inline_sums:
        sum_ = SUM_BUFFERS.get(tier)
        if sum_ is None:  # registered once per tier: Mooncake refuses a second time
            sum_ = SUM_BUFFERS[tier] = np.zeros(len(sum_bytes), np.uint8)
            b.register(memoryview(sum_))
        sum_[:] = np.frombuffer(sum_bytes, np.uint8)
        assert b.put_summed([name], [memoryview(data)], [memoryview(sum_)]) == [True]
    else:
        assert b.put_chunks([name], [memoryview(data)]) == [True]
    if b.sum_objects:
        assert b.put_small([name + SUM_SUFFIX], [sum_bytes]) == [True]


def fill(region, slots, seed):
    rng = np.random.default_rng(seed)
    for s in slots:
        region[s] = rng.integers(0, 256, CHUNK, dtype=np.uint8)


def test_store_lookup_load_round_trip_exact_bytes(make):
    tier, region = make()
    fill(region, range(4), seed=1)
    assert [look(tier, k) for k in KEYS[:4]] == [LookupResult.MISS] * 4
    assert run(tier, KEYS[:4], range(4), False).success
    assert [look(tier, k) for k in KEYS[:4]] == [LookupResult.HIT] * 4
    fill(region, range(8, 12), seed=99)  # poison the destination
    res = run(tier, KEYS[:4], range(8, 12), True)
    assert res.success and res.transfer_bytes == 4 * CHUNK
    assert np.array_equal(region[8:12], region[0:4])
    assert tier.get_finished_jobs() == []  # each job is reported once


def test_a_second_engine_with_the_same_identity_reads_the_objects(make):
    a, region_a = make()
    b, region_b = make()
    fill(region_a, [0], seed=2)
    assert run(a, KEYS[:1], [0], False).success
    assert look(b, KEYS[0]) is LookupResult.HIT
    assert run(b, KEYS[:1], [5], True).success
    assert np.array_equal(region_b[5], region_a[0])


def test_a_load_with_a_gap_copies_each_chunk_to_its_slot(make):
    tier, region = make()
    fill(region, range(7), seed=12)
    assert run(tier, KEYS[:7], range(7), False).success
    fill(region, range(8, 16), seed=98)  # poison the destination
    keys = KEYS[:3] + [KEYS[7]] + KEYS[3:7]  # KEYS[7] was never stored
    res = run(tier, keys, range(8, 16), True)
    assert not res.success and list(res.successful_keys) == KEYS[:7]
    assert np.array_equal(region[8:11], region[0:3])
    assert np.array_equal(region[12:16], region[3:7])
    assert tier.quarantine.held == set()  # no G2 slot kept from vLLM


def test_moves_outside_the_job_table_copy_and_report_through_done(make):
    seen = []
    tier, region = make(observer=lambda load, keys, ok: seen.append((load, list(keys), list(ok))))
    fill(region, range(3), seed=13)
    done = []
    tier.move(False, KEYS[:3], [0, 1, 2], done.append)
    tier.drain_hints()  # drain covers moves
    assert done == [[True, True, True]]
    assert [look(tier, k) for k in KEYS[:3]] == [LookupResult.HIT] * 3
    fill(region, range(8, 12), seed=97)  # poison the destination
    tier.move(True, [KEYS[0], KEYS[6], KEYS[2]], [8, 9, 10], done.append)
    tier.drain_hints()
    assert done[1] == [True, False, True]
    assert np.array_equal(region[8], region[0]) and np.array_equal(region[10], region[2])
    assert tier.get_finished_jobs() == []  # not vLLM's jobs
    assert seen == [
        (False, KEYS[:3], [True] * 3),
        (True, [KEYS[0], KEYS[6], KEYS[2]], [True, False, True]),
    ]


def test_a_copy_goes_to_the_backend_in_bounded_calls(make, monkeypatch):
    # Redis' replies to one pipeline are all in memory at once: a hint wave
    # of 65,536 x 2 MiB chunks in one call would hold 128 GiB in the engine.
    # Here 12 chunks of 1 MiB in calls of 2: a load holds at most about one
    # call's bytes of the backend's (12 MiB for Redis in one call).
    mib = 1 << 20
    monkeypatch.setattr(g3, "BATCH_BYTES", 2 * mib)
    tier, region = make(chunk=mib)
    rng = np.random.default_rng(14)
    region[:12] = rng.integers(0, 256, (12, mib), dtype=np.uint8)
    keys, want, done = KEYS[:8] + [block_key(i) for i in range(20, 24)], region[:12].copy(), []
    tier.move(False, keys, range(12), done.append)
    tier.drain_hints()
    region[:12] = 0xAA  # poison the destination
    tracemalloc.start()
    try:
        tier.move(True, keys, range(12), done.append)
        tier.drain_hints()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done == [[True] * 12] * 2
    assert np.array_equal(region[:12], want)
    assert peak < 5 * mib, f"{peak / mib:.1f} MiB held to load 12 MiB in calls of 2 MiB"


def test_a_move_in_flight_neither_keeps_the_engine_stepping_nor_holds_up_a_reset(make):
    # vLLM steps an idle engine while a tier has_pending_work(): a hint copy
    # (its end comes through the Mover's wake-up) spun a core until it ended.
    # And a reset (drain_jobs) waited for every hint copy, however large.
    tier, region = make()
    fill(region, range(2), seed=15)
    started, release, done = threading.Event(), threading.Event(), []

    def finish(ok):
        started.set()
        release.wait(30)
        done.append(ok)

    tier.move(False, KEYS[:2], [0, 1], finish)
    assert started.wait(30)
    assert not tier.has_pending_work()  # in flight, yet idle
    tier.drain_jobs()  # a reset goes on at once
    assert done == [] and tier.quarantine.held == {0, 1}  # its slots are not G2's meanwhile
    release.set()
    tier.drain_hints()
    assert done == [[True, True]] and tier.quarantine.held == set()


def test_pins_hold_the_objects_and_leave_them_readable(make):
    tier, region = make()
    fill(region, range(3), seed=14)
    assert run(tier, KEYS[:3], range(3), False).success
    done = []
    slots = [0, 1, 2] if tier.pin_needs_bytes else None  # rewritten from G2 where needed
    tier.pin(KEYS[:3], 60.0, slots, done.append)
    tier.drain_hints()
    assert done == [[True, True, True]]
    fill(region, range(8, 11), seed=96)
    assert run(tier, KEYS[:3], range(8, 11), True).success
    assert np.array_equal(region[8:11], region[0:3])


def pin_calls(tier):
    """Spy (no fake): the number of chunks in each of the tier's real
    ``backend.pin`` calls, and a hook run after each call returns."""
    calls, after = [], []
    per = len(tier.objects(KEYS[0]))  # objects per chunk

    def spy(names, ttl_s, values, _pin=tier._backend.pin):
        got = _pin(names, ttl_s, values)
        calls.append(len(names) // per)
        for hook in after:
            hook()
        return got

    tier._backend.pin = spy
    return calls, after


def test_a_pin_goes_in_bounded_slices_and_copies_no_session(make, monkeypatch):
    # A Mooncake Pin built bytes(chunk) + seal for every chunk at once (tens of
    # GB in the engine for a long session on a big model) and upserted them in
    # one call through the client's 16 MiB local buffer: past it, the whole
    # Pin failed. Here 12 chunks of 2 MiB (24 MiB), slices of 3 chunks.
    mib, n = 1 << 20, 12
    chunk = 2 * mib
    monkeypatch.setattr(g3_layout, "PIN_SLICE_CHUNKS", 3)
    monkeypatch.setattr(g3_layout, "PIN_SLICE_BYTES", 3 * (chunk + SUM.size))
    tier, region = make(chunk=chunk, seal_key=MAC_KEY)
    keys = KEYS[:8] + [block_key(i) for i in range(30, 30 + n - 8)]
    region[:n] = np.random.default_rng(23).integers(0, 256, (n, chunk), dtype=np.uint8)
    assert run(tier, keys, range(n), False).success
    calls, _ = pin_calls(tier)
    done = []
    tracemalloc.start()
    try:
        tier.pin(keys, 60.0, list(range(n)) if tier.pin_needs_bytes else None, done.append)
        tier.drain_hints()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done == [[True] * n]
    assert calls == [3] * 4  # bounded calls
    assert peak < chunk, f"{peak / mib:.1f} MiB held to pin {n} chunks of {chunk // mib} MiB"
    assert tier.quarantine.held == set()
    # The rewritten objects: another engine with the key loads every chunk,
    # verified (data and seal, a MAC over name and bytes, exactly as stored).
    other, oregion = make(chunk=chunk, seal_key=MAC_KEY)
    oregion[:n] = 0xAA  # poison the destination
    assert [look(other, k) for k in keys] == [LookupResult.HIT] * n
    assert run(other, keys, range(n), True).success
    assert np.array_equal(oregion[:n], region[:n])


def test_a_pin_cut_short_by_an_outage_keeps_what_it_pinned(faulty):
    # The backend stops after the first slice: the rest of the Pin fails
    # within one deadline (the breaker), its first slice is pinned and
    # reported so, and the tier pins and loads again once the backend is back.
    import signal

    tier, service = faulty
    tier._pins.slice = 2
    region = np.frombuffer(tier._region, np.uint8).reshape(N_CHUNKS, CHUNK)
    fill(region, range(6), seed=24)
    assert run(tier, KEYS[:6], range(6), False).success
    slots = list(range(6)) if tier.pin_needs_bytes else None
    calls, after = pin_calls(tier)
    after.append(lambda: service.signal(signal.SIGSTOP))
    done = []
    try:
        t0 = time.monotonic()
        tier.pin(KEYS[:6], 60.0, slots, done.append)
        tier.drain_hints()
        assert time.monotonic() - t0 < 3.0 and tier.guard.trips >= 1
        assert calls == [2]  # the second slice's call has not returned
    finally:
        after.clear()
        service.signal(signal.SIGCONT)
    assert done == [[True, True] + [False] * 4]
    deadline = time.monotonic() + 20
    while True:  # the breaker lets calls by again
        tier.pin(KEYS[:6], 60.0, slots, done.append)
        tier.drain_hints()
        if done[-1] == [True] * 6:
            break
        assert time.monotonic() < deadline, done[-1]
        time.sleep(0.3)
    fill(region, range(8, 14), seed=95)  # poison the destination
    assert run(tier, KEYS[:6], range(8, 14), True).success
    assert np.array_equal(region[8:14], region[:6])
    staging = getattr(tier._pins, "_staging", None)  # a rewriting pin's buffer
    while tier.quarantine.held or (staging and staging.free < staging.slots):
        assert time.monotonic() < deadline  # the late call ended
        time.sleep(0.1)


def test_redis_pins_persist_then_the_ttl_comes_back(request):
    import redis

    url = request.getfixturevalue("redis_url")
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = Redis.tier(url, spec(), memoryview(region), f"pin-{uuid.uuid4().hex[:8]}", ttl_s=60)
    try:
        fill(region, [0, 1], seed=15)
        assert run(tier, KEYS[:2], [0, 1], False).success
        names = [tier.name(k) + sfx for k in KEYS[:2] for sfx in ("", SUM_SUFFIX)]
        r = redis.Redis.from_url(url)
        assert all(0 < r.ttl(n) <= 60 for n in names)  # evictable under volatile-lru
        done = []
        tier.pin(KEYS[:1], 1.0, None, done.append)
        tier.drain_hints()
        assert done == [[True]]
        assert [r.ttl(n) for n in names[:2]] == [-1, -1]  # PERSISTed: not evictable
        assert all(r.ttl(n) > 0 for n in names[2:])  # the unpinned one keeps its TTL
        deadline = time.monotonic() + 10
        while not all(r.ttl(n) > 0 for n in names[:2]):  # the pin lapsed
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        tier.shutdown()


def test_redis_pins_under_a_namespace_acl_and_a_start_sweeps_every_ended_lease(request):
    """docs/guides/security.md's per-tenant ACL (keys ``<namespace>/*`` only): Pins work
    (the lease set is the namespace's own; one set for every namespace
    failed NOPERM), and an engine start ends all of a crash's 3,000 ended
    leases in its namespace (a start ended 1,000), none of another's."""
    import redis

    url = request.getfixturevalue("redis_url")
    admin = redis.Redis.from_url(url)
    ns, other = f"acl-{uuid.uuid4().hex[:8]}", f"acl-{uuid.uuid4().hex[:8]}"
    user, password = f"u-{ns}", uuid.uuid4().hex
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=[f"{ns}/*"], commands=["+@all"]
    )
    left = {f"{n}/dead-{i}": 0 for n in (ns, other) for i in range(3000)}
    admin.mset({k: b"x" for k in left})  # persistent, as a crashed engine's pins left them
    for n in (ns, other):
        admin.zadd(f"{n}/pin-leases", {k: 1.0 for k in left if k.startswith(n + "/")})
    own_url = url.replace("redis://", f"redis://{user}:{password}@")
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = Redis.tier(own_url, spec(), memoryview(region), ns, ttl_s=60)
    try:
        assert admin.zcard(f"{ns}/pin-leases") == 0 and admin.zcard(f"{other}/pin-leases") == 3000
        assert all(0 < t <= 60 for t in (admin.ttl(f"{ns}/dead-{i}") for i in range(0, 3000, 97)))
        assert admin.ttl(f"{other}/dead-0") == -1
        fill(region, [0], seed=16)
        assert run(tier, KEYS[:1], [0], False).success
        done = []
        tier.pin(KEYS[:1], 30.0, None, done.append)
        tier.drain_hints()
        assert done == [[True]] and admin.ttl(tier.name(KEYS[0])) == -1
        assert not admin.exists("sessionkv/pin-leases")
    finally:
        tier.shutdown()
        admin.acl_deluser(user)
        admin.delete(*left, f"{ns}/pin-leases", f"{other}/pin-leases")


def test_mooncake_soft_pins_survive_eviction(tmp_path):
    from sessionkv.devtools.services import start_mooncake

    ports, master, store = start_mooncake(tmp_path, store_size="16MB")
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = Mooncake.tier(ports, spec(), memoryview(region), "pins")
    try:
        fill(region, range(4), seed=16)
        assert run(tier, KEYS[:4], range(4), False).success
        done = []
        tier.pin(KEYS[:2], 300.0, [0, 1], done.append)
        tier.drain_hints()
        assert done == [[True, True]]
        # Fill the store several times over: the master evicts, never the pinned.
        filler = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        backend = tier._backend
        for i in range(64):
            backend.put_small([f"pins/filler-{i}"], [filler.tobytes()])
            time.sleep(0.02)
        time.sleep(2)
        there = [all(backend.exists(tier.objects(k))) for k in KEYS[:4]]
        assert there[:2] == [True, True]
        assert not all(there[2:4]), "nothing was evicted: the test proves nothing"
    finally:
        tier.shutdown()
        store.stop()
        master.stop()


@pytest.mark.parametrize("name", ["lmcache", "mooncake"])
def test_a_read_past_its_deadline_keeps_its_g2_slots_until_it_ends(name, tmp_path):
    # Inline-checksum backends read straight into G2: a read from a stopped
    # store process (Mooncake's, or LMCache's server) runs on past the
    # tier's deadline, until the process goes on or the socket times out.
    import signal

    backend = BACKENDS[name]
    where, _, services = backend.own(tmp_path)
    store = services[0]
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = backend.tier(where, spec(), memoryview(region), "late", timeout_s=0.5, retry_s=0.3)
    try:
        fill(region, [0, 1], seed=17)
        assert run(tier, KEYS[:2], [0, 1], False).success
        assert look(tier, KEYS[0]) is LookupResult.HIT
        store.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            res = run(tier, KEYS[:2], [4, 5], True)
            assert not res.success and not res.successful_keys
            assert time.monotonic() - t0 < 3.0
            assert tier.quarantine.held == {4, 5}  # vLLM must not reuse them
        finally:
            store.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while tier.quarantine.held:  # the read ended: given back
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        tier.shutdown()
        for s in services:
            s.stop()


def test_storing_what_is_there_succeeds_and_a_move_keeps_it(make):
    """vLLM's cascade of a chunk that is there (another engine's, in a race)
    succeeds, and loads read one whole version; a hint's move asks first
    and keeps what is there."""
    tier, region = make()
    fill(region, [0, 1, 2], seed=3)
    assert run(tier, KEYS[:1], [0], False).success
    assert run(tier, KEYS[:1], [1], False).success  # other bytes, same key
    assert run(tier, KEYS[:1], [4], True).success
    there = region[4].copy()
    assert np.array_equal(there, region[0]) or np.array_equal(there, region[1])
    done = []
    tier.move(False, KEYS[:1], [2], done.append)  # other bytes again
    tier.drain_hints()
    assert done == [[True]]
    assert run(tier, KEYS[:1], [5], True).success
    assert np.array_equal(region[5], there)


def test_missing_objects_fail_their_load_and_only_theirs(make):
    tier, region = make()
    fill(region, [0, 1], seed=4)
    assert run(tier, KEYS[:2], [0, 1], False).success
    res = run(tier, [KEYS[0], KEYS[5], KEYS[1]], [8, 9, 10], True)
    assert not res.success and set(res.successful_keys) == {KEYS[0], KEYS[1]}
    res = run(tier, KEYS[6:8], [8, 9], True)
    assert not res.success and not res.successful_keys


def test_corrupted_bytes_fail_the_checksum(make):
    tier, region = make()
    fill(region, [0, 1], seed=5)
    assert run(tier, KEYS[:2], [0, 1], False).success
    fill(region, [3], seed=6)  # other bytes of the right size
    plant(tier, KEYS[0], region[3], like=region[0])  # with the right checksum
    res = run(tier, KEYS[:2], [8, 9], True)
    assert not res.success and list(res.successful_keys) == [KEYS[1]]
    # No second promotion of the bad chunk, here or in another engine.
    assert look(tier, KEYS[0]) is LookupResult.MISS
    other, _ = make()
    assert look(other, KEYS[0]) is LookupResult.MISS
    assert look(other, KEYS[1]) is LookupResult.HIT


def test_short_objects_and_missing_checksums_are_misses(make):
    tier, region = make()
    fill(region, [0, 1], seed=7)
    assert run(tier, KEYS[:2], [0, 1], False).success
    plant(tier, KEYS[0], region[0][: CHUNK // 2], like=region[0])  # short
    b = tier._backend
    if b.sum_objects:
        assert b.remove([tier.name(KEYS[1]) + SUM_SUFFIX]) == [True]  # no checksum object
        assert look(tier, KEYS[1]) is LookupResult.MISS  # so never listed
    res = run(tier, KEYS[:2], [8, 9], True)
    if b.inline_sums:  # the checksum is in the object too: KEYS[1] still verifies
        assert not res.success and list(res.successful_keys) == [KEYS[1]]
        assert np.array_equal(region[9], region[1])
    else:  # its only checksum is gone: a miss
        assert not res.success and not res.successful_keys
    assert look(tier, KEYS[0]) is LookupResult.MISS


def test_an_oversized_planted_object_is_a_miss_never_read_whole(make):
    """A store writer without the key plants 16 MiB under a 4 KiB chunk's
    name (and its checksum object's): lookups and the load miss, and the
    engine never holds the object (it read 1.5 GiB to load 32 KiB)."""
    tier, region = make()
    fill(region, [0, 1], seed=31)
    assert run(tier, KEYS[:2], [0, 1], False).success
    b, big = tier._backend, np.full(16 << 20, 7, np.uint8)
    for name in tier.objects(KEYS[0]):
        assert b.remove([name]) == [True] and b.put_small([name], [memoryview(big)]) == [True]
    fill(region, [8, 9], seed=32)
    tracemalloc.start()
    try:
        look(tier, KEYS[0])
        res = run(tier, KEYS[:2], [8, 9], True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not res.success and list(res.successful_keys) == [KEYS[1]]
    assert np.array_equal(region[9], region[1])
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held for a 16 MiB planted object"


@pytest.mark.parametrize("make", ["lmcache", "redis"], indirect=True)  # checksum objects
def test_orphaned_objects_are_absent_unlisted_and_stored_again(make):
    """A chunk whose data object is gone while its checksum object stays (what
    Redis' eviction does to them one by one), or the other way round, is
    absent: lookups miss where the backend evicts (Redis), a load unlists the
    orphan so no engine fails on it again, and stores write the chunk anew."""
    tier, region = make()
    b = tier._backend
    fill(region, [0, 1], seed=21)
    assert run(tier, KEYS[:2], [0, 1], False).success
    data, sums = [tier.name(k) for k in KEYS[:2]], [tier.name(k) + SUM_SUFFIX for k in KEYS[:2]]
    assert b.remove([data[0], sums[1]]) == [True, True]  # evicted, one object each
    if type(b).__name__ == "RedisBackend":  # LMCache never evicts: no lookup asks
        assert [look(tier, k) for k in KEYS[:2]] == [LookupResult.MISS] * 2
    else:
        assert look(tier, KEYS[1]) is LookupResult.MISS
    fill(region, [8], seed=98)  # poison the destination
    res = run(tier, KEYS[:1], [8], True)  # a Prefetch of what the index knew
    assert not res.success and not res.successful_keys
    assert b.exists([sums[0]]) == [False]  # the orphan is unlisted
    other, oregion = make()
    assert [look(other, k) for k in KEYS[:2]] == [LookupResult.MISS] * 2
    fill(oregion, [0, 1], seed=21)  # the same chunks, computed again
    assert run(other, KEYS[:2], [0, 1], False).success  # stored anew, not skipped
    assert [look(other, k) for k in KEYS[:2]] == [LookupResult.HIT] * 2
    fill(oregion, [8, 9], seed=97)
    assert run(other, KEYS[:2], [8, 9], True).success
    assert np.array_equal(oregion[8:10], region[0:2])


MAC_KEY = derive(b"cluster secret for the contract tests", G3_MAC)


def test_with_the_cluster_key_a_writer_without_it_plants_nothing(make):
    """Sealed with the cluster's MAC key, objects that a writer without the
    key made (right size, with the checksum it computed: what an unkeyed
    checksum cannot stop) under a live key, and pre-seeded under a future
    one, both fail their load, are unlisted and counted; the next store
    writes the real chunk and another engine with the key loads it."""
    tier, region = make(seal_key=MAC_KEY)
    fill(region, [0, 1, 2], seed=11)
    assert run(tier, KEYS[:1], [0], False).success
    fill(region, [3], seed=12)
    plant(tier, KEYS[0], region[3], like=region[3])  # over a live object
    seed(tier, KEYS[1], region[3])  # before the engine stores it
    b = tier._backend
    listed = [tier.name(k) + tier._layout.listing for k in KEYS[:2]]
    assert b.exists(listed) == [True, True]
    fill(region, [8, 9], seed=99)  # poison the destinations
    res = run(tier, KEYS[:2], [8, 9], True)
    assert not res.success and not res.successful_keys and tier.rejected == 2
    assert b.exists(listed) == [False, False]  # unlisted
    assert run(tier, KEYS[:2], [0, 1], False).success  # the real chunks
    other, oregion = make(seal_key=MAC_KEY)
    assert [look(other, k) for k in KEYS[:2]] == [LookupResult.HIT] * 2
    assert run(other, KEYS[:2], [4, 5], True).success
    assert np.array_equal(oregion[4:6], region[0:2])


def test_an_object_planted_before_a_hint_copy_is_replaced(make):
    """A store writer without the key plants a chunk's object before the
    engine stores it (or before vLLM's cascade of it, which Mooncake answers
    with success while keeping the planted object); a Demote of that chunk
    must not take it for the engine's own: the copy replaces it, and another
    engine loads the real bytes. A chunk another engine wrote and this one verified by a load is
    not written again (its bytes stay the first engine's)."""
    tier, region = make(seal_key=MAC_KEY)
    fill(region, [0, 1, 2, 3], seed=41)
    seed(tier, KEYS[0], region[3])  # planted, before any store
    seed(tier, KEYS[2], region[3])  # and before vLLM's cascade of it
    assert run(tier, KEYS[2:3], [2], False).success  # Mooncake keeps what is there
    done = []
    tier.move(False, KEYS[:3], [0, 1, 2], done.append)  # a Demote
    tier.drain_hints()
    assert done == [[True, True, True]]
    other, oregion = make(seal_key=MAC_KEY)
    fill(oregion, [4, 5, 6, 7, 8], seed=42)  # poison the destinations
    assert run(other, KEYS[:3], [4, 5, 8], True).success
    assert np.array_equal(oregion[[4, 5, 8]], region[0:3])
    tier.move(False, KEYS[:2], [6, 7], done.append)  # verified there: kept
    other.move(False, KEYS[:2], [6, 7], done.append)
    tier.drain_hints()
    other.drain_hints()
    assert done[1:] == [[True, True]] * 2
    assert run(tier, KEYS[:2], [8, 9], True).success
    assert np.array_equal(region[8:10], region[0:2]) and tier.rejected == 0


def test_engines_with_other_seals_name_other_objects(make):
    """With another key, or none, an engine names other objects (the seal is
    in the fingerprint): it never reads, nor unlists as failing, the
    objects of engines sealing otherwise."""
    tier, _ = make(seal_key=MAC_KEY)
    other, _ = make(seal_key=derive(b"another cluster", G3_MAC))
    plain, _ = make()
    assert len({tier.prefix, other.prefix, plain.prefix}) == 3


@pytest.mark.parametrize(
    "other",
    [
        {"block_size": 64},  # another block size
        {"dtype": "bfloat16"},  # another KV dtype
        {"model": str(MODELS / "realistic")},  # another model
    ],
)
def test_another_identity_is_a_miss(make, other):
    tier, region = make()
    fill(region, [0], seed=8)
    assert run(tier, KEYS[:1], [0], False).success
    stranger, _ = make(spec(**other))
    assert stranger.prefix != tier.prefix
    assert look(stranger, KEYS[0]) is LookupResult.MISS
    res = run(stranger, KEYS[:1], [3], True)
    assert not res.success


def test_many_jobs_in_flight_drain_and_report_once(make):
    tier, region = make()
    fill(region, range(8), seed=9)
    jobs = [job([k], [i], False) for i, k in enumerate(KEYS)]
    for j in jobs:
        tier.submit_store(j)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == sorted(j.job_id for j in jobs)
    assert all(r.success for r in results) and not tier.has_pending_work()


def test_a_hung_backend_costs_deadlines_then_recovers(faulty):
    import signal

    tier, service = faulty
    region = np.frombuffer(tier._region, np.uint8).reshape(N_CHUNKS, CHUNK)
    fill(region, [0, 1], seed=10)
    assert run(tier, KEYS[:2], [0, 1], False).success
    service.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert look(tier, KEYS[0]) is LookupResult.MISS  # no answer: a miss
        assert not run(tier, KEYS[:2], [4, 5], True).success  # load fails, bounded
        assert not run(tier, KEYS[2:4], [2, 3], False).success  # store fails, bounded
        tier.drain_jobs()
        assert time.monotonic() - t0 < 5.0 and tier.guard.trips >= 1
    finally:
        service.signal(signal.SIGCONT)
    time.sleep(0.5)
    deadline = time.monotonic() + 10
    while look(tier, KEYS[1]) is not LookupResult.HIT:  # reconnects by itself
        assert time.monotonic() < deadline
        time.sleep(0.2)
    fill(region, [8, 9], seed=99)
    res = run(tier, KEYS[1:2], [9], True)
    assert res.success and np.array_equal(region[9], region[1])
    deadline = time.monotonic() + 10
    sums = getattr(tier._layout, "sums", None)  # InlineSums' checksum slots
    while tier.quarantine.held or (sums and sums.free < sums.slots):
        assert time.monotonic() < deadline, tier.quarantine.held  # abandoned reads ended
        time.sleep(0.1)
