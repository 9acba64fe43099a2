"""G3: shared storage below G2, one tier contract over every backend.

``G3Tier`` is a vLLM ``SecondaryTierManager``: vLLM cascades chunks stored in
G2 down to it (``submit_store``) and promotes chunks from it into G2 slots it
reserved (``submit_load``); both copy straight between the shared G2 host
region and the backend. A backend (Mooncake Store, Redis, LMCache) only has to
be an ``ObjectBackend``: whole objects by name, in and out of that region.

Objects, per chunk (``OffloadKey`` = the chunk's last block key)::

    <namespace>/<fingerprint>/<key hex>        the chunk's bytes, zero-copy
    <namespace>/<fingerprint>/<key hex>.sum    16 bytes: xxh3-64 and length

The fingerprint (``tiers.fingerprint``) makes engines whose bytes are not
interchangeable miss each other. The checksum object is written only after
its data object was stored, and is what ``lookup`` asks for; a load verifies
the bytes it copied against it. Never wrong KV: a chunk whose checksum object
is missing, whose data is missing, short, or does not match, fails its load,
and vLLM recomputes it (the G2 slot it was copied into is freed, unread).
A chunk that failed a load is a miss for ``MISS_AFTER_FAILURE_S`` (vLLM would
otherwise promote it again at once, forever), and a chunk that failed its
checksum loses its checksum object, so no engine finds it again.

Threading: vLLM calls the tier on the scheduler thread; copies run on the
tier's I/O threads, which report finished jobs through a queue that
``get_finished_jobs`` drains. ``drain_jobs`` waits for all of them.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, ClassVar

import xxhash
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .fingerprint import fingerprint, identity_fields, weights_digest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = init_logger(__name__)
SUM = struct.Struct("<QQ")          # xxh3-64 of the chunk, its length
SUM_SUFFIX = ".sum"
MISS_AFTER_FAILURE_S = 30.0
MAX_FAILED = 65_536


def checksum(data) -> bytes:
    """The checksum object of one chunk's bytes."""
    return SUM.pack(xxhash.xxh3_64_intdigest(data), len(data))


class ObjectBackend(ABC):
    """Named whole objects in a shared store, moved to and from one host region.

    ``bind_region`` comes first (once); offsets and sizes are bytes within that
    region. Every batch call returns one result per item, in order, and never
    raises for one item's failure (a backend error is ``False`` / ``None``).
    Methods are called from the tier's I/O threads and from the scheduler
    thread (``exists``), possibly at once.
    """

    @abstractmethod
    def bind_region(self, region: memoryview, address: int) -> None:
        """The host region (G2) every copy reads from or writes into."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put_chunks(self, names: Sequence[str], offsets: Sequence[int], size: int) -> list[bool]:
        """Store ``size`` bytes at each offset as the named object (zero-copy
        where the backend can). An existing object of that name may be kept."""

    @abstractmethod
    def get_chunks(self, names: Sequence[str], offsets: Sequence[int], size: int) -> list[bool]:
        """Copy each named object into the region at its offset; False unless
        the whole object arrived and is exactly ``size`` bytes."""

    @abstractmethod
    def put_small(self, names: Sequence[str], values: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get_small(self, names: Sequence[str]) -> list[bytes | None]: ...

    @abstractmethod
    def remove(self, names: Sequence[str]) -> list[bool]:
        """Delete objects; True where the object is gone (or never was)."""

    def close(self) -> None:
        return


class G3Tier(SecondaryTierManager):
    """A vLLM secondary tier over an ``ObjectBackend`` (see the module docstring).
    Subclasses build the backend in ``make_backend``; every other keyword of
    their tier config goes there."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        backend: ObjectBackend,
        namespace: str = "sessionkv",
        io_threads: int = 2,
        backpressure_detector: "BackpressureDetector | None" = None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty name without '/', got {namespace!r}")
        self._chunk = primary_kv_view.strides[0]
        self._region = primary_kv_view.cast("B") if primary_kv_view.ndim > 1 or \
            primary_kv_view.format != "B" else primary_kv_view
        self._identity = spec_identity(offloading_spec, self._chunk)
        self._namespace = namespace
        self._prefix: str | None = None
        self._backend = backend
        backend.bind_region(self._region,
                            ctypes.addressof(ctypes.c_char.from_buffer(self._region)))
        self._pool = ThreadPoolExecutor(max_workers=io_threads,
                                        thread_name_prefix=f"sessionkv-{tier_type}")
        self._pending: set[Future] = set()
        self._done: list[JobResult] = []
        self._failed: dict[str, float] = {}     # name -> until when it is a miss
        self._lock = threading.Lock()

    # ---- names ----------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """``<namespace>/<fingerprint>/``. Computed at first use: the block
        hash root (``NONE_HASH``) is set after the engine built this tier."""
        if self._prefix is None:
            from vllm.v1.core import kv_cache_utils
            root = getattr(kv_cache_utils, "NONE_HASH", None)
            if root is None:
                raise RuntimeError("vLLM's block hash root is not set: cannot name G3 objects")
            fp = fingerprint({**self._identity, "none_hash": bytes(root)})
            self._prefix = f"{self._namespace}/{fp}/"
            logger.info("sessionkv: G3 tier %s, objects %s*", self.tier_type, self._prefix)
        return self._prefix

    def name(self, key: OffloadKey) -> str:
        return self.prefix + bytes(key).hex()

    # ---- vLLM's contract (scheduler thread) ------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        name = self.name(key)
        if self._failed:
            with self._lock:
                until = self._failed.get(name)
                if until is not None:
                    if until > time.monotonic():
                        return LookupResult.MISS
                    del self._failed[name]
        (hit,) = self._backend.exists([name + SUM_SUFFIX])
        return LookupResult.HIT if hit else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._backend.close()
        self._region.release()      # else the primary tier cannot unmap G2

    # ---- I/O threads ----------------------------------------------------------------

    def _submit(self, fn, job: TransferJob) -> None:
        keys = list(job.keys)
        names = [self.name(k) for k in keys]
        offsets = [int(c) * self._chunk for c in job.chunk_ids]
        fut = self._pool.submit(self._run, fn, job.job_id, keys, names, offsets)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._finished)

    def _finished(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _run(self, fn, job_id: int, keys: list[OffloadKey], names: list[str],
             offsets: list[int]) -> None:
        start = time.monotonic()
        try:
            ok = fn(names, offsets)
        except Exception:           # a backend bug fails the job, never the engine
            logger.exception("sessionkv: G3 job %d failed", job_id)
            ok = []
        good = [k for k, o in zip(keys, ok) if o]
        if len(good) < len(keys) and fn == self._load:
            self._remember_failed([n for n, o in zip(names, ok) if not o])
        result = JobResult(job_id=job_id, success=len(good) == len(keys),
                           successful_keys=good if len(good) < len(keys) else None,
                           transfer_time=time.monotonic() - start,
                           transfer_bytes=len(good) * self._chunk)
        with self._lock:
            self._done.append(result)

    def _remember_failed(self, names: list[str]) -> None:
        until = time.monotonic() + MISS_AFTER_FAILURE_S
        with self._lock:
            for n in names:
                self._failed.pop(n, None)
                self._failed[n] = until
            while len(self._failed) > MAX_FAILED:
                del self._failed[next(iter(self._failed))]

    def _store(self, names: list[str], offsets: list[int]) -> list[bool]:
        have = self._backend.exists([n + SUM_SUFFIX for n in names])
        todo = [i for i, h in enumerate(have) if not h]
        ok = list(have)
        if todo:
            sums = [checksum(self._region[offsets[i]:offsets[i] + self._chunk]) for i in todo]
            put = self._backend.put_chunks([names[i] for i in todo],
                                           [offsets[i] for i in todo], self._chunk)
            stored = [i for i, p in zip(todo, put) if p]
            # The checksum goes last: a lookup never finds a chunk whose data is not there.
            sums_ok = self._backend.put_small([names[i] + SUM_SUFFIX for i in stored],
                                              [s for i, s, p in zip(todo, sums, put) if p])
            for i, s in zip(stored, sums_ok):
                ok[i] = s
        return ok

    def _load(self, names: list[str], offsets: list[int]) -> list[bool]:
        want = self._backend.get_small([n + SUM_SUFFIX for n in names])
        got = self._backend.get_chunks(names, offsets, self._chunk)
        ok, broken = [], []
        for name, off, w, g in zip(names, offsets, want, got):
            good = bool(g) and w is not None and len(w) == SUM.size and \
                w == checksum(self._region[off:off + self._chunk])
            if w is not None and not good:      # listed, but its data is gone, short or wrong
                broken.append(name)
            ok.append(good)
        if broken:
            logger.warning("sessionkv: %d G3 objects unreadable or failing their checksum "
                           "(%s...): recomputing, and unlisting them", len(broken), broken[0])
            self._backend.remove([n + SUM_SUFFIX for n in broken])
        return ok


def spec_identity(spec: "OffloadingSpec", chunk_bytes: int) -> dict:
    """The identity fields of this engine's chunks (``tiers.fingerprint``),
    ``none_hash`` left empty: vLLM sets it after it built the scheduler."""
    cfg = spec.config
    par = cfg.parallel
    return identity_fields(
        weights=weights_digest(cfg.model.name), dtype=str(cfg.model.dtype),
        block_size=cfg.cache.tokens_per_hash, blocks_per_chunk=cfg.cache.blocks_per_chunk,
        layout=f"{cfg.kv_cache_layout}/canonical={cfg.canonical_layout}"
               f"/replicated={cfg.replicated_layout}",
        tp=par.tp_size, pp=par.pp_size, pcp=par.pcp_size, dcp=par.dcp_size,
        none_hash=b"", chunk_bytes=chunk_bytes)

