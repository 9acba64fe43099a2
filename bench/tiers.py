"""G3 tier throughput against the raw backend, the checksum and memcpy.

    scripts/netns .venv/bin/python bench/tiers.py --json OUT [--backend mooncake|redis|lmcache]
        [--mac] [--sizes 65536,1048576,16777216]

For each backend and chunk size (64 KiB, 1 MiB, 16 MiB; 64 MiB per batch),
put and get, in one run on the same bytes: ``tier_MBps`` (a ``G3Tier`` job
as vLLM's cascades and promotions run it: checksums; Redis asks which chunks
are there, then writes data and checksum objects; Mooncake and LMCache write
each chunk with its checksum inline, LMCache its checksum object too; loads
verified in the G2 slot, or before a copy into it (Redis)), ``raw_MBps`` (the backend's own batch
call: Mooncake ``batch_put_from``/``batch_get_into``, a Redis pipeline, a
pipelined lm:// exchange with LMCache's server),
``raw_checksum_MBps`` (the same plus the xxh3 checksum of every chunk),
``raw_mac_MBps`` (the same plus the keyed BLAKE3 MAC that ``--mac`` tiers
seal with), and ``memcpy_MBps`` (a copy of the same bytes). With ``--mac``
the tier seals its objects with a MAC key (a cluster secret in the policy). Best of ``--repeat`` rounds, the
variants taking turns in each round; each backend in a process of its own. Rows:
``{backend, block_bytes, op, seal, tier_MBps, raw_MBps, raw_checksum_MBps, raw_mac_MBps,
memcpy_MBps, tier_over_raw_checksum, tier_over_raw_checksum_rounds, tier_over_raw_mac,
tier_over_raw_mac_rounds}``: the medians of the per-round ratios, and the ratios of each
round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH_BYTES = 64 << 20
SIZES = (64 << 10, 1 << 20, 16 << 20)


def rates(variants: dict, nbytes: int, repeat: int) -> dict[str, float]:
    """Best MB/s of each variant over ``repeat`` rounds; each round runs every
    variant once, in turn, the first one rotating (drift on a noisy machine
    hits them alike). A
    variant is ``(run, cleanup)``; cleanup runs untimed after each run. With
    a tier and a raw+checksum variant, also ``tier_over_raw_checksum``: the
    median over rounds of their ratio within the round (pairs measured side
    by side vary less than the best of each), and the ratio of each round."""
    per = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(repeat):
        # Each round starts with another variant: a slow phase of the
        # backend (a Python server's allocator, say) hits no one position.
        for name, (fn, cleanup) in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            fn()
            per[name].append(nbytes / (time.perf_counter() - t0) / 1e6)
            cleanup()
    out = {name: max(r) for name, r in per.items()}
    for base in ("raw_checksum", "raw_mac"):
        if "tier_MBps" in per and f"{base}_MBps" in per:
            ratios = [round(t / c, 3) for t, c in zip(per["tier_MBps"], per[f"{base}_MBps"])]
            out[f"tier_over_{base}"] = statistics.median(ratios)
            out[f"tier_over_{base}_rounds"] = ratios
    return out


def raw_calls(backend: str, tier):
    """The backend's own batch put and get over the tier's client."""
    from sessionkv.tiers.g3.tier import address_of

    b = tier._backend
    if backend == "mooncake":

        def put(names, bufs):
            rcs = b._store.batch_put_from(
                names, [address_of(x) for x in bufs], [len(x) for x in bufs]
            )
            assert all(rc == 0 for rc in rcs), rcs

        def get(names, bufs):
            rcs = b._store.batch_get_into(
                names, [address_of(x) for x in bufs], [len(x) for x in bufs]
            )
            assert all(rc == len(x) for rc, x in zip(rcs, bufs)), rcs
    elif backend == "lmcache":

        def put(names, bufs):
            assert all(b.put_chunks(names, bufs))

        def get(names, bufs):
            assert b.get_chunks(names, bufs) == [len(x) for x in bufs]
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


def measure(backend: str, where, chunk: int, repeat: int, mac: bool = False) -> list[dict]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from sessionkv.devtools.g3_spec import standalone_spec
    from sessionkv.keys import G3_MAC, derive
    from sessionkv.tiers.g3.backend import Seal
    from sessionkv.tiers.g3.tier import checksum

    init_none_hash(sha256)
    n = max(1, BATCH_BYTES // chunk)
    region = np.random.default_rng(0).integers(0, 256, (2 * n, chunk), dtype=np.uint8)
    view = memoryview(region)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    spec = standalone_spec(str(ROOT / ".cache" / "models" / "tiny"), chunk)
    key = derive(b"bench cluster secret", G3_MAC)
    kw = {"seal_key": key} if mac else {}
    seal = Seal(key)
    if backend == "mooncake":
        from sessionkv.devtools.services import lan_address
        from sessionkv.tiers.g3.backends.mooncake import MooncakeTier

        tier = MooncakeTier(
            spec,
            view,
            "mooncake",
            master=where.master,
            metadata_server=where.metadata_url,
            local_hostname=lan_address(),
            namespace=ns,
            timeout_s=30.0,
            **kw,
        )
    elif backend == "lmcache":
        from sessionkv.tiers.g3.backends.lmcache import LMCacheTier

        tier = LMCacheTier(spec, view, "lmcache", url=where, namespace=ns, timeout_s=30.0, **kw)
    else:
        from sessionkv.tiers.g3.backends.redis import RedisTier

        tier = RedisTier(spec, view, "redis", url=where, namespace=ns, timeout_s=30.0, **kw)
    try:
        src = [memoryview(region[i]) for i in range(n)]
        dst = [memoryview(region[n + i]) for i in range(n)]
        put, get = raw_calls(backend, tier)
        jobs = iter(range(1, 1 << 30))
        total = n * chunk
        created: list[str] = []  # objects a put made; removed untimed after it

        def fresh():
            names = [f"{ns}/raw-{uuid.uuid4().hex}" for _ in range(n)]
            created.extend(names)
            return names

        def remove_created():
            tier._backend.remove(created)
            created.clear()

        def tier_job(keys, slots, load):
            j = TransferJob(
                next(jobs), keys, np.asarray(slots, np.int64), load, ReqContext(req_id="bench")
            )
            (tier.submit_load if load else tier.submit_store)(j)
            tier.drain_jobs()
            (r,) = [r for r in tier.get_finished_jobs() if r.job_id == j.job_id]
            assert r.success

        def tier_put():
            keys = [uuid.uuid4().bytes * 2 + bytes(4) for _ in range(n)]
            created.extend(o for k in keys for o in tier.objects(k))
            tier_job(keys, range(n), False)

        def raw_checksum_put():
            for x in src:
                checksum(x)
            put(fresh(), src)

        def raw_mac_put():
            names = fresh()
            for name, x in zip(names, src):
                seal(name, x)
            put(names, src)

        stored = [f"{ns}/raw-get-{i}" for i in range(n)]
        put(stored, src)
        tier_keys = [uuid.uuid4().bytes * 2 + bytes(4) for _ in range(n)]
        tier_job(tier_keys, range(n), False)

        def raw_checksum_get():
            get(stored, dst)
            for x in dst:
                checksum(x)

        def raw_mac_get():
            get(stored, dst)
            for name, x in zip(stored, dst):
                seal(name, x)

        def nothing():
            return None

        puts = rates(
            {
                "raw_MBps": (lambda: put(fresh(), src), remove_created),
                "raw_checksum_MBps": (raw_checksum_put, remove_created),
                "raw_mac_MBps": (raw_mac_put, remove_created),
                "tier_MBps": (tier_put, remove_created),
            },
            total,
            repeat,
        )
        gets = rates(
            {
                "raw_MBps": (lambda: get(stored, dst), nothing),
                "raw_checksum_MBps": (raw_checksum_get, nothing),
                "raw_mac_MBps": (raw_mac_get, nothing),
                "tier_MBps": (lambda: tier_job(tier_keys, range(n, 2 * n), True), nothing),
            },
            total,
            repeat,
        )
        memcpy = rates(
            {"memcpy_MBps": (lambda: np.copyto(region[n:], region[:n]), nothing)}, total, repeat
        )
        rows = [
            {
                "backend": backend,
                "block_bytes": chunk,
                "op": op,
                "seal": "mac" if mac else "xxh3",
                **r,
                **memcpy,
            }
            for op, r in (("put", puts), ("get", gets))
        ]
        # Leave the store as it was: the next chunk size needs the room.
        tier._backend.remove(stored + [o for k in tier_keys for o in tier.objects(k)])
        return rows
    finally:
        tier.shutdown()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--backend", choices=["mooncake", "redis", "lmcache"], action="append")
    # One round's ratio varies 0.7-1.5 here (a few ms of noise on 20-40 ms):
    # the median of 15 moved ±0.06 run to run, of 45 about ±0.03.
    ap.add_argument("--repeat", type=int, default=45)
    ap.add_argument(
        "--mac",
        action="store_true",
        help="the tier seals its objects with a keyed MAC (a cluster secret)",
    )
    ap.add_argument(
        "--sizes",
        default=",".join(str(x) for x in SIZES),
        help="chunk sizes in bytes, a comma list",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    backends = args.backend or ["mooncake", "redis", "lmcache"]
    if len(backends) > 1:
        # Each backend in a process of its own: a closed Mooncake client
        # leaves threads behind that slowed the next backend's tier (more
        # threads than its raw calls) by up to 40 % in one process.
        rows = []
        with tempfile.TemporaryDirectory() as out:
            for backend in backends:
                part = Path(out) / f"{backend}.json"
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--backend",
                        backend,
                        "--repeat",
                        str(args.repeat),
                        "--json",
                        str(part),
                        "--sizes",
                        args.sizes,
                    ]
                    + (["--mac"] if args.mac else []),
                    check=True,
                )
                rows += json.loads(part.read_text())["rows"]
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
        return
    from sessionkv.devtools.services import start_lmcache, start_mooncake, start_redis

    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for backend in backends:
            if backend == "mooncake":
                ports, master, store = start_mooncake(Path(logs), store_size="1GB")
                stop = [store, master]
                where = ports
            elif backend == "lmcache":
                where, server = start_lmcache(Path(logs))
                stop = [server]
            else:
                where, server = start_redis(Path(logs), maxmemory="1gb")
                stop = [server]
            try:
                for chunk in map(int, args.sizes.split(",")):
                    rows += measure(backend, where, chunk, args.repeat, args.mac)
                    r = rows[-2:]
                    print(
                        " ".join(
                            f"{x['backend']:8s} {x['block_bytes'] >> 10:6d} KiB {x['op']}: "
                            f"tier {x['tier_MBps']:8.0f} raw {x['raw_MBps']:8.0f} "
                            f"raw+sum {x['raw_checksum_MBps']:8.0f} "
                            f"raw+mac {x['raw_mac_MBps']:8.0f} "
                            f"memcpy {x['memcpy_MBps']:8.0f} MB/s, tier/raw+sum "
                            f"{x['tier_over_raw_checksum']:.2f}, tier/raw+mac "
                            f"{x['tier_over_raw_mac']:.2f}\n"
                            for x in r
                        ),
                        end="",
                    )
            finally:
                for s in stop:
                    s.stop()
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
