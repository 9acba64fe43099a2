"""Redis pins end even when their engine does not: a Pin's objects are
persistent under a lease (``tiers/g3/backends/redis.py``), ended at expiry where no
longer pin holds, at a graceful shutdown, and, after a crash, by the next
engine on the server. On the real Redis server; the crash is a real
``SIGKILL`` of the process that pinned."""

import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from test_g3_contract import CHUNK, KEYS, N_CHUNKS, SUM_SUFFIX, Redis, fill, pin_calls, run, spec


@pytest.fixture
def tiers(request):
    """Builds Redis tiers on the session's server, all in one namespace."""
    url = request.getfixturevalue("redis_url")
    namespace = f"lease-{uuid.uuid4().hex[:8]}"
    made = []

    def build(namespace_=None):
        region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
        tier = Redis.tier(url, spec(), memoryview(region), namespace_ or namespace, ttl_s=60)
        made.append(tier)
        return tier, region

    yield url, build
    for t in made:
        t.shutdown()


def pin(tier, keys, ttl_s):
    done = []
    tier.pin(keys, ttl_s, None, done.append)
    tier.drain_hints()
    assert done == [[True] * len(keys)]


def objects(tier, keys):
    return [tier.name(k) + sfx for k in keys for sfx in ("", SUM_SUFFIX)]


def wait_for(cond, within_s=10.0):
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.1)


def test_a_graceful_shutdown_gives_the_ttl_back(tiers):
    url, build = tiers
    tier, region = build()
    fill(region, [0], seed=31)
    assert run(tier, KEYS[:1], [0], False).success
    pin(tier, KEYS[:1], 600.0)
    r, names = redis.Redis.from_url(url), objects(tier, KEYS[:1])
    assert [r.ttl(n) for n in names] == [-1, -1]
    tier.shutdown()
    assert all(0 < r.ttl(n) <= 60 for n in names)


def test_one_engine_ending_its_pin_leaves_a_longer_one_of_another(tiers):
    url, build = tiers
    a, region = build()
    b, _ = build()
    fill(region, [0], seed=32)
    assert run(a, KEYS[:1], [0], False).success
    pin(a, KEYS[:1], 1.0)
    pin(b, KEYS[:1], 600.0)
    r, names = redis.Redis.from_url(url), objects(a, KEYS[:1])
    time.sleep(2.5)  # a's pin lapsed and was ended
    assert [r.ttl(n) for n in names] == [-1, -1]  # b's still holds
    b.shutdown()
    assert all(r.ttl(n) > 0 for n in names)


PINNER = textwrap.dedent("""
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_g3_contract import CHUNK, KEYS, N_CHUNKS, Redis, fill, run, spec
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = Redis.tier({url!r}, spec(), memoryview(region), {namespace!r}, ttl_s=60)
    fill(region, [0], seed=33)
    assert run(tier, KEYS[:1], [0], False).success
    done = []
    tier.pin(KEYS[:1], 1.0, None, done.append)
    tier.drain_hints()
    print(tier.name(KEYS[0]), done, flush=True)
    time.sleep(600)
""")


def test_after_a_crash_the_next_engine_ends_the_lapsed_pins(tiers, tmp_path):
    url, build = tiers
    namespace = f"crash-{uuid.uuid4().hex[:8]}"
    script = PINNER.format(tests=str(Path(__file__).parent), url=url, namespace=namespace)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        name, done = proc.stdout.readline().split(" ", 1)
        assert done.strip() == "[[True]]"
    finally:
        proc.send_signal(signal.SIGKILL)  # no lapse, no shutdown
        proc.wait()
    r, names = redis.Redis.from_url(url), [name, name + SUM_SUFFIX]
    time.sleep(2.0)  # its lease ended; nobody ended the pin
    assert [r.ttl(n) for n in names] == [-1, -1]
    build(namespace)  # the next engine on the namespace
    assert all(0 < r.ttl(n) <= 60 for n in names)


def test_a_pin_cut_short_still_ends_the_pins_it_made(tmp_path):
    """A Pin goes to Redis in slices. When the server stops after the first,
    the rest fails within a deadline, and the first slice's objects, made
    persistent under their lease, get their TTL back at the pin's expiry:
    each slice's pins are handed to the lapses as it ends."""
    from sessionkv.devtools.services import start_redis

    url, server = start_redis(tmp_path)
    region = np.zeros((N_CHUNKS, CHUNK), np.uint8)
    tier = Redis.tier(
        url,
        spec(),
        memoryview(region),
        f"cut-{uuid.uuid4().hex[:8]}",
        ttl_s=60,
        timeout_s=0.5,
        retry_s=0.3,
    )
    try:
        tier._pins.slice = 2
        fill(region, range(4), seed=34)
        assert run(tier, KEYS[:4], range(4), False).success
        _, after = pin_calls(tier)
        after.append(lambda: server.signal(signal.SIGSTOP))
        done = []
        try:
            tier.pin(KEYS[:4], 3.0, None, done.append)
            tier.drain_hints()
        finally:
            after.clear()
            server.signal(signal.SIGCONT)
        assert done == [[True, True, False, False]]
        r, names = redis.Redis.from_url(url), objects(tier, KEYS[:2])
        assert [r.ttl(n) for n in names] == [-1] * 4  # pinned: not evictable
        wait_for(lambda: all(0 < r.ttl(n) <= 60 for n in names))
    finally:
        tier.shutdown()
        server.stop()
