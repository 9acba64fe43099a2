"""RedisBackend against a real redis-server: what a store costs in memory."""

import tracemalloc

from sessionkv.tiers.g3.backends.redis import RedisBackend


def test_a_store_sends_chunks_from_g2_without_copying_them(redis_url):
    # With hiredis installed, redis-py's default serializer ran bytes() on
    # every value and joined the pipeline into one more copy: a put of 16 MiB
    # of chunks allocated 17 MiB in the engine (issue "production scale").
    backend = RedisBackend(redis_url, ttl_s=60)
    region = memoryview(bytearray(range(256)) * (16 << 12))  # 16 MiB
    chunks = [region[i << 20 : (i + 1) << 20] for i in range(16)]
    names = [f"zero-copy/{i}" for i in range(16)]
    assert all(backend.put_chunks(names, chunks))  # connection made
    tracemalloc.start()
    try:
        assert all(backend.put_chunks(names, chunks))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB allocated to store 16 MiB"
    back = [memoryview(bytearray(1 << 20)) for _ in names]
    assert backend.get_chunks(names, back) == [1 << 20] * 16
    assert all(b == c for b, c in zip(back, chunks))
    backend.remove(names)
    backend.close()
