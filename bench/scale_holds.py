"""The longest hold of the tier manager's lock by one hint's work, at the
production G2 size: a Share, a Prefetch and a Pin of one session's chunks.

Real parts, built as ``SessionTierSpec`` builds them (vLLM's CPU primary tier
with ``SessionCachePolicy``, the index, the manager with its hint executor and
Mover) over a ``DiskTier`` G3 in a temporary directory. G2 is full of other
sessions' chunks first, so the Prefetch evicts as it reserves. The hints come
as the control channel sends them (``control_hints``); the copies finish as
the control thread finishes them (``apply_moves`` under the lock, woken by
the Mover). Every hold of the lock is timed (the manager's lock is wrapped:
a bench-only instrument), from the hint's arrival to its final outcome.

``hint_holds(...)`` runs each hint twice: with the Mover's slices
(``moves.SLICE_CHUNKS``) and with one slice as large as the copy (the
Mover before slices), so the figure and its comparison come from one run.
"""

from __future__ import annotations

import select
import tempfile
import threading
import time

from replay_router import make_hint
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import ReqContext

from sessionkv.config import SessionKVConfig
from sessionkv.connectors.manager import SessionTierManager
from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.g2 import standalone_g2
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.devtools.keys import block_key
from sessionkv.engine import mover as moves
from sessionkv.engine.service import G3Copies
from sessionkv.events import EventLog, Outcome
from sessionkv.hints import Action, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g3.backends.disk import DiskTier
from sessionkv.tiers.g3.tier import Quarantine
from sessionkv.types import Tier

CHUNK = 4096


class TimedLock:
    """A plain lock that records how long each hold lasted (seconds)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since = 0.0
        self.holds: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._since = time.perf_counter()
        return got

    def release(self) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def _manager(g2_chunks: int, g3_dir: str):
    init_none_hash(sha256)  # what the engine does at start
    index, quarantine, copies, events = SessionPrefixIndex(), Quarantine(), G3Copies(), EventLog()
    primary = standalone_g2(g2_chunks, CHUNK, index, quarantine, events, page_size=CHUNK)
    g3 = DiskTier(
        standalone_spec(str(MODELS / "tiny"), CHUNK),
        primary.get_kv_memoryview(),
        "disk",
        path=g3_dir,
        max_bytes=1 << 40,
        namespace="holds",
        quarantine=quarantine,
        observer=copies.observe,
    )
    m = SessionTierManager(primary, [g3], index, SessionKVConfig(), copies, events)
    return m


def _store(m, session: str, n: int, tag: str) -> list[bytes]:
    keys = [block_key(f"{tag}{i}") for i in range(n)]
    ctx = ReqContext(req_id=f"store-{tag}")
    with m.lock:
        for i in range(0, n, 4096):
            part = keys[i : i + 4096]
            out = m.primary_tier.prepare_store(part, ctx)
            m.primary_tier.complete_store(out.keys_to_store, ctx)
        m.index.admit(session, keys, Tier.G2)
    return keys


def _hint(m, lock: TimedLock, action: Action, session: str, **kw) -> dict:
    """One hint from arrival to final outcome; its holds of the lock."""
    lock.holds.clear()
    t0 = time.perf_counter()
    (first,) = m.service.control_hints([make_hint(action, session, **kw)], session, "bench")
    final = first
    seen = 0
    while final.status is Status.DEFERRED:
        select.select([m.service.wake.fd], [], [], 1.0)
        m.service.wake.drain()
        with m.lock:
            m.service.apply_moves()
        evs, _, _ = m.event_log.since(seen, 100_000)
        seen += len(evs)
        for e in evs:
            if (
                isinstance(e, Outcome)
                and e.outcome.hint_id == first.hint_id
                and e.outcome.status is not Status.DEFERRED
            ):
                final = e.outcome
    return {
        "status": final.status.value,
        "blocks": final.blocks_affected,
        "holds": len(lock.holds),
        "longest_hold_ms": round(max(lock.holds) * 1e3, 3),
        "first_hold_ms": round(lock.holds[0] * 1e3, 3),
        "copy_hold_ms": round(max(lock.holds[1:], default=0.0) * 1e3, 3),
        "copy_hold_p50_ms": round(sorted(lock.holds[1:])[len(lock.holds[1:]) // 2] * 1e3, 3)
        if len(lock.holds) > 1
        else 0.0,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def hint_holds(g2_chunks: int, session_chunks: int, slice_chunks: int | None = None) -> dict:
    """Share, then Prefetch (after G2 was refilled by others), then Pin of a
    session of ``session_chunks``, with G2 of ``g2_chunks``; each hint's
    longest hold of the lock. ``slice_chunks``: the Mover's slice (default
    ``moves.SLICE_CHUNKS``)."""
    saved = moves.SLICE_CHUNKS
    if slice_chunks is not None:
        moves.SLICE_CHUNKS = slice_chunks
    try:
        with tempfile.TemporaryDirectory(prefix="sessionkv-holds-") as d:
            m = _manager(g2_chunks, d)
            lock = m._lock = TimedLock()  # the instrument (module docstring)
            try:
                _store(m, "s", session_chunks, "s")
                _store(m, "other", g2_chunks - session_chunks, "o")
                out = {"share": _hint(m, lock, Action.SHARE, "s", destination="self")}
                _store(m, "later", g2_chunks, "l")  # G2 forgets the session
                out["prefetch"] = _hint(m, lock, Action.PREFETCH, "s")
                out["pin"] = _hint(m, lock, Action.PIN, "s", ttl_s=60)
            finally:
                m.shutdown()
        out["longest_hold_ms"] = max(v["longest_hold_ms"] for v in out.values())
        out["copy_hold_ms"] = max(v["copy_hold_ms"] for v in out.values() if isinstance(v, dict))
        out["slice_chunks"] = moves.SLICE_CHUNKS
        return out
    finally:
        moves.SLICE_CHUNKS = saved


if __name__ == "__main__":
    import json
    import sys

    g2, n = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (262_144, 16_384)
    print(json.dumps({"sliced": hint_holds(g2, n), "one_slice": hint_holds(g2, n, n)}, indent=1))
