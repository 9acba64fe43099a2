"""G3 tier throughput against the raw backend, the checksum and memcpy.

    scripts/netns .venv/bin/python bench/tiers.py --json OUT [--backend mooncake|redis]

For each backend and chunk size (64 KiB, 1 MiB, 16 MiB; 64 MiB per batch),
put and get, in one run on the same bytes: ``tier_MBps`` (a ``G3Tier`` job:
existence check, checksum, data and checksum objects; loads through staging,
verified, copied into the G2 slot), ``raw_MBps`` (the backend's own batch
call: Mooncake ``batch_put_from``/``batch_get_into``, a Redis pipeline),
``raw_checksum_MBps`` (the same plus the xxh3 checksum of every chunk), and
``memcpy_MBps`` (a copy of the same bytes). Best of ``--repeat`` runs. Rows:
``{backend, block_bytes, op, tier_MBps, raw_MBps, raw_checksum_MBps, memcpy_MBps}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH_BYTES = 64 << 20
SIZES = (64 << 10, 1 << 20, 16 << 20)


def best(fn, nbytes: int, repeat: int) -> float:
    out = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out = max(out, nbytes / (time.perf_counter() - t0) / 1e6)
    return out


def raw_calls(backend: str, tier):
    """The backend's own batch put and get over the tier's client."""
    from sessionkv.tiers.g3 import address_of
    b = tier._backend
    if backend == "mooncake":
        def put(names, bufs):
            rcs = b._store.batch_put_from(names, [address_of(x) for x in bufs], [len(x) for x in bufs])
            assert all(rc == 0 for rc in rcs), rcs

        def get(names, bufs):
            rcs = b._store.batch_get_into(names, [address_of(x) for x in bufs], [len(x) for x in bufs])
            assert all(rc == len(x) for rc, x in zip(rcs, bufs)), rcs
    else:
        def put(names, bufs):
            pipe = b._redis.pipeline(transaction=False)
            for n, x in zip(names, bufs):
                pipe.set(n, x, ex=3600)
            assert all(pipe.execute())

        def get(names, bufs):
            pipe = b._redis.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            for v, x in zip(pipe.execute(), bufs):
                x[:] = v
    return put, get


def measure(backend: str, where, chunk: int, repeat: int) -> list[dict]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from sessionkv.tiers.g3 import checksum, standalone_spec
    init_none_hash(sha256)
    n = max(1, BATCH_BYTES // chunk)
    region = np.random.default_rng(0).integers(0, 256, (2 * n, chunk), dtype=np.uint8)
    view = memoryview(region)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    spec = standalone_spec(str(ROOT / ".cache" / "models" / "tiny"), chunk)
    if backend == "mooncake":
        from sessionkv.services import lan_address
        from sessionkv.tiers.mooncake import MooncakeTier
        tier = MooncakeTier(spec, view, "mooncake", master=where.master,
                            metadata_server=where.metadata_url, local_hostname=lan_address(),
                            namespace=ns, staging_chunks=n, timeout_s=30.0)
    else:
        from sessionkv.tiers.redis import RedisTier
        tier = RedisTier(spec, view, "redis", url=where, namespace=ns,
                         staging_chunks=n, timeout_s=30.0)
    try:
        src = [memoryview(region[i]) for i in range(n)]
        dst = [memoryview(region[n + i]) for i in range(n)]
        put, get = raw_calls(backend, tier)
        jobs = iter(range(1, 1 << 30))
        total = n * chunk

        created: list[str] = []

        def fresh(tag):
            names = [f"{ns}/raw-{tag}-{uuid.uuid4().hex}" for _ in range(n)]
            created.extend(names)
            return names

        def tier_job(keys, slots, load):
            j = TransferJob(next(jobs), keys, np.asarray(slots, np.int64), load,
                            ReqContext(req_id="bench"))
            (tier.submit_load if load else tier.submit_store)(j)
            tier.drain_jobs()
            (r,) = [r for r in tier.get_finished_jobs() if r.job_id == j.job_id]
            assert r.success

        keys_made: list[list[bytes]] = []

        def tier_put():
            keys = [uuid.uuid4().bytes * 2 + bytes(4) for _ in range(n)]
            keys_made.append(keys)
            tier_job(keys, range(n), False)

        def raw_checksum_put():
            for x in src:
                checksum(x)
            put(fresh("c"), src)

        stored = fresh("g")
        put(stored, src)

        def raw_checksum_get():
            get(stored, dst)
            for x in dst:
                checksum(x)

        rows = []
        put_row = {"backend": backend, "block_bytes": chunk, "op": "put",
                   "raw_MBps": best(lambda: put(fresh("r"), src), total, repeat),
                   "raw_checksum_MBps": best(raw_checksum_put, total, repeat),
                   "tier_MBps": best(tier_put, total, repeat)}
        get_row = {"backend": backend, "block_bytes": chunk, "op": "get",
                   "raw_MBps": best(lambda: get(stored, dst), total, repeat),
                   "raw_checksum_MBps": best(raw_checksum_get, total, repeat),
                   "tier_MBps": best(lambda: tier_job(keys_made[0], range(n, 2 * n), True),
                                     total, repeat)}
        memcpy = best(lambda: np.copyto(region[n:], region[:n]), total, repeat)
        for row in (put_row, get_row):
            row["memcpy_MBps"] = memcpy
            rows.append(row)
        # Leave the store as it was: the next chunk size needs the room.
        created += [tier.name(k) + sfx for keys in keys_made for k in keys for sfx in ("", ".sum")]
        tier._backend.remove(created)
        return rows
    finally:
        tier.shutdown()


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--backend", choices=["mooncake", "redis"], action="append")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from sessionkv.services import start_mooncake, start_redis

    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for backend in args.backend or ("mooncake", "redis"):
            if backend == "mooncake":
                ports, master, store = start_mooncake(Path(logs), store_size="1GB")
                stop = [store, master]
                where = ports
            else:
                where, server = start_redis(Path(logs), maxmemory="1gb")
                stop = [server]
            try:
                for chunk in SIZES:
                    rows += measure(backend, where, chunk, args.repeat)
                    r = rows[-2:]
                    print(" ".join(f"{x['backend']:8s} {x['block_bytes'] >> 10:6d} KiB {x['op']}: "
                                   f"tier {x['tier_MBps']:8.0f} raw {x['raw_MBps']:8.0f} "
                                   f"raw+sum {x['raw_checksum_MBps']:8.0f} "
                                   f"memcpy {x['memcpy_MBps']:8.0f} MB/s\n" for x in r), end="")
            finally:
                for s in stop:
                    s.stop()
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
