"""Peak engine-process memory of a G3 Pin of a long session (issue 52).

    python bench/pin_memory.py --json OUT [--backend disk] [--chunks 6250] [--chunk-bytes N]
    scripts/netns .venv/bin/python bench/pin_memory.py --json OUT --backend mooncake

A real ``G3Tier`` (``DiskTier`` on a temporary directory, no service; or
``MooncakeTier`` on a master and store process of its own, sized to hold the
session, which needs ``scripts/netns``) stores a session of ``--chunks``
chunks (default 6,250: 100k tokens at 16 a chunk) of ``--chunk-bytes``
(default 512 KiB: Llama-3.2-1B's KV in bf16 for 16 tokens), then pins all of
them as a Pin hint does (``G3Tier.pin``; Mooncake rewrites each object from
its G2 slot). G2 here holds ``REGION_SLOTS`` chunks and chunk ``i`` lives in
slot ``i % REGION_SLOTS`` (each object is its slot's bytes, sealed under its
own name): G2's size is not what is measured.

Figures, each against idle (after the stores, ``gc.collect()``): the first
pin's RSS delta (``first_pin_rss_delta_mib``: it also makes the tier's pin
staging resident, allocated with the tier but not touched before), a second
pin's RSS delta and its ``tracemalloc`` peak (Python and numpy allocations
during the pin); RSS sampled every ``SAMPLE_S`` on a thread of its own. Then
``verified``: every ``VERIFY_EVERY``-th chunk loaded back into G2 through the
tier, sealed and byte-exact (a run where a chunk was not pinned or not
verified raises: it measured nothing). Target: the worst figure
(``worst_over_idle_mib``) at most ``TARGET_MIB``, "within a few MiB of
idle". Before the bounded pins, a Mooncake Pin built ``bytes(chunk) + seal``
for every chunk at once, the whole session (``session_mib``) in Python, and
failed past the client's 16 MiB local buffer.

``measure()`` is what ``bench/scale.py`` calls for its ``pin_memory`` key.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil

REGION_SLOTS = 256
VERIFY_SLOTS = 64  # more G2 slots, which the verifying loads write into
VERIFY_EVERY = 25
STORE_WAVE = 512  # chunks a store call
SAMPLE_S = 0.002
TARGET_MIB = 6.0
MIB = 1 << 20


class _PeakRss:
    """The largest RSS seen while running, sampled on a thread of its own."""

    def __init__(self):
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _tier(backend: str, chunk_bytes: int, session_bytes: int, where: Path, region):
    """(tier, services to stop)."""
    from sessionkv.devtools.engines import MODELS
    from sessionkv.devtools.g3_spec import standalone_spec

    spec = standalone_spec(str(MODELS / "tiny"), chunk_bytes)
    if backend == "disk":
        from sessionkv.tiers.g3.backends.disk import DiskTier

        return DiskTier(
            spec,
            memoryview(region),
            "disk",
            path=str(where / "g3"),
            max_bytes=4 * session_bytes,
            namespace="pin-memory",
            timeout_s=10.0,
        ), []
    if backend == "mooncake":
        from sessionkv.devtools.services import lan_address, start_mooncake
        from sessionkv.tiers.g3.backends.mooncake import MooncakeTier

        store_mb = int(session_bytes * 1.5 / MIB) + 256
        ports, master, store = start_mooncake(where / "mooncake", store_size=f"{store_mb}MB")
        try:
            tier = MooncakeTier(
                spec,
                memoryview(region),
                "mooncake",
                master=ports.master,
                metadata_server=ports.metadata_url,
                local_hostname=lan_address(),
                namespace="pin-memory",
                timeout_s=10.0,
            )
        except Exception:
            store.stop()
            master.stop()
            raise
        return tier, [store, master]
    raise ValueError(f"--backend: disk or mooncake, got {backend!r}")


def _copy(tier, load: bool, keys, slots) -> list[bool]:
    done: list = []
    tier.move(load, keys, slots, done.append)
    tier.drain_hints()
    return done[0]


def measure(backend: str = "disk", chunks: int = 6250, chunk_bytes: int = 512 << 10) -> dict:
    """The figures of one run (see the module docstring)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    from sessionkv.devtools.keys import block_key
    from sessionkv.tiers.g3 import layout as g3_layout

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:  # what an engine does at start
        kv_cache_utils.init_none_hash(sha256)
    session_bytes = chunks * chunk_bytes
    where = Path(tempfile.mkdtemp(prefix="sessionkv-pin-memory-"))
    region = np.random.default_rng(0).integers(
        0, 256, (REGION_SLOTS + VERIFY_SLOTS, chunk_bytes), dtype=np.uint8
    )
    tier, services = _tier(backend, chunk_bytes, session_bytes, where, region)
    try:
        keys = [block_key(i) for i in range(1, chunks + 1)]
        slots = [i % REGION_SLOTS for i in range(chunks)]
        t0 = time.perf_counter()
        for i in range(0, chunks, STORE_WAVE):
            ok = _copy(tier, False, keys[i : i + STORE_WAVE], slots[i : i + STORE_WAVE])
            if not all(ok):
                raise RuntimeError(f"stores failed: {ok.count(False)} of chunks {i}..")
        store_s = time.perf_counter() - t0
        pin_slots = slots if tier.pin_needs_bytes else None
        runs = []
        for traced in (False, True):
            done: list = []
            gc.collect()
            idle = psutil.Process().memory_info().rss
            if traced:
                tracemalloc.start()
            t0 = time.perf_counter()
            with _PeakRss() as rss:
                tier.pin(keys, 600.0, pin_slots, done.append)
                tier.drain_hints()
            pin_s = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1] if traced else None
            if traced:
                tracemalloc.stop()
            runs.append(
                {
                    "idle_rss_mib": round(idle / MIB, 1),
                    "rss_delta_mib": round((rss.peak - idle) / MIB, 2),
                    "tracemalloc_peak_mib": None if peak is None else round(peak / MIB, 2),
                    "pin_s": round(pin_s, 2),
                    "pinned": sum(done[0]) if done else 0,
                }
            )
        # Loaded back through the tier: the load verifies each seal in G2.
        verified = checked = 0
        sample = list(range(0, chunks, VERIFY_EVERY))
        for i in range(0, len(sample), VERIFY_SLOTS):
            part = sample[i : i + VERIFY_SLOTS]
            dest = list(range(REGION_SLOTS, REGION_SLOTS + len(part)))
            region[dest] = 0xAA
            ok = _copy(tier, True, [keys[j] for j in part], dest)
            checked += len(part)
            verified += sum(
                o and np.array_equal(region[d], region[slots[j]]) for o, d, j in zip(ok, dest, part)
            )
        first, second = runs
        worst = max(first["rss_delta_mib"], second["rss_delta_mib"], second["tracemalloc_peak_mib"])
        if not first["pinned"] == second["pinned"] == chunks or verified < checked:
            raise RuntimeError(
                f"the Pin measured nothing: pinned {first['pinned']} and "
                f"{second['pinned']} of {chunks}, verified {verified} of {checked}"
            )
        return {
            "backend": backend,
            "chunks": chunks,
            "chunk_bytes": chunk_bytes,
            "session_mib": round(session_bytes / MIB, 1),
            "slice_chunks": tier._pins.slice,
            "pin_slice_bytes": g3_layout.PIN_SLICE_BYTES if tier.pin_needs_bytes else 0,
            "store_s": round(store_s, 1),
            "first_pin_rss_delta_mib": first["rss_delta_mib"],
            "first_pin": first,
            "pin": second,
            "verified": verified,
            "verify_sampled": checked,
            "worst_over_idle_mib": worst,
            "target_mib": TARGET_MIB,
            "met": worst <= TARGET_MIB,
        }
    finally:
        tier.shutdown()
        for s in services:
            s.stop()
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--backend", default="disk", choices=["disk", "mooncake"])
    ap.add_argument("--chunks", type=int, default=6250)
    ap.add_argument("--chunk-bytes", type=int, default=512 << 10)
    args = ap.parse_args()
    out = {"pin_memory": measure(args.backend, args.chunks, args.chunk_bytes)}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
