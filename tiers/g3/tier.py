"""G3: shared storage below G2, one tier contract over every backend.

``G3Tier`` is a vLLM ``SecondaryTierManager``: vLLM cascades chunks stored in
G2 down to it (``submit_store``) and promotes chunks from it into G2 slots it
reserved (``submit_load``). A backend (Mooncake Store, Redis, LMCache) only
has to be an ``ObjectBackend``: whole objects by name, copied from and into
host buffers.

Objects, per chunk (``OffloadKey`` = the chunk's last block key)::

    <namespace>/<fingerprint>/<key hex>        the chunk's bytes (then, with
                                               ``inline_sums``, its checksum)
    <namespace>/<fingerprint>/<key hex>.sum    16 bytes: its seal (``sum_objects``)

A chunk's seal (``g3_backend.Seal``) is xxh3-64 and length, or, where the
policy names a cluster secret, a keyed BLAKE3 MAC over the object's name
and bytes (key ``sessionkv.keys.derive(secret, G3_MAC)``): a writer without
the key cannot make an object the engine loads, under any name. Without a
secret the checksum catches torn and corrupted objects only.

Mooncake keeps the checksum inline only, Redis in checksum objects only,
LMCache both (its server has no cheap existence call: lookups read the small
object, loads only the data object). The fingerprint (``tiers.g3.fingerprint``)
makes engines whose bytes are not interchangeable miss each other. The
checksum object is written only after its data object was stored. Lookups
and stores ask whether the chunk is there (``Layout.asked``): Redis, which
evicts the two objects one by one, for both; LMCache, which never evicts,
for the checksum object; Mooncake for the data object. Stores of
vLLM's cascades (chunks just computed) ask only where a second put could
hurt: with checksum objects, which loads check (Redis), or where a put keeps
an object already there and says nothing (Mooncake). A hint's copy keeps a
chunk found there only if this tier wrote or verified its object (the last
``MAX_MINE``) and replaces any other, so a copy that reports a chunk stored
stored its bytes.

The backend's modes are strategy objects chosen once (``tiers/g3/layout``):
its ``Layout`` (``InlineSums`` or ``SumObjects``: where checksums live, how
stores write and loads verify them) and its ``Pins``. Names, lookups and one
backend call's worth of a copy are ``G3Objects``' (``tiers/g3/objects.py``),
which ``G3Tier`` extends.

Never wrong KV. A load verifies the bytes against their checksum before the
chunk counts as loaded: bytes read into buffers of the backend's own
(``SumObjects``) are verified and then copied into the G2 slot; bytes read
straight into the G2 slot (``InlineSums``) are verified there, and a failed
slot is never made readable. A chunk whose checksum is
missing, or whose data is missing, short or different, fails its load and
vLLM recomputes it. A chunk that failed is a
miss in this engine for ``MISS_AFTER_FAILURE_S`` (vLLM would promote it again
at once, forever), and a listed chunk that failed is unlisted (both objects
removed) so no engine finds it again: so is an orphan, a checksum object
whose data object is gone.

Never blocking. vLLM calls the tier on the scheduler thread, and nothing
there waits for the backend: lookups are asynchronous (vLLM's
``AsyncLookupManager``: ``RETRY`` until the answer is in), copies run on the
tier's I/O threads. Every backend call has our own deadline (``timeout_s``
plus the bytes at ``MIN_RATE``); a call past it is abandoned and trips a
breaker: for ``retry_s`` every call fails at once as a miss, then the next
call probes the backend again. So a stopped backend costs each request at
most one deadline, a dead one none, and the tier reconnects by itself when
the backend is back. An abandoned read may still write the G2 slots it was
given: they stay in ``quarantine`` (shared with the primary tier, which
keeps them out of its free list) until the call ends. ``drain_jobs`` waits
only for vLLM's copies within their deadline; hint copies (``move``,
``pin``) hold their G2 slots in the quarantine until they end, so a reset
need not wait for them.

Memory: a copy goes to the backend in calls of at most ``BATCH_BYTES`` of
chunks, so a backend that reads into buffers of its own holds at most that
much per copy in flight. A pin goes in slices of bounded calls; one that
rewrites objects (Mooncake) stages a slice at a time in a registered buffer
of ``g3_layout.PIN_SLICE_BYTES``, allocated with the tier.

Threading: vLLM's calls on the scheduler thread; vLLM's copies on the I/O
threads, hint copies and pins on threads of their own (``io_threads`` each);
backend calls on the guard's threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from sessionkv.tiers.g3.backend import SUM_SUFFIX, ObjectBackend, Seal, address_of, checksum
from sessionkv.tiers.g3.backpressure import CascadeQueue
from sessionkv.tiers.g3.events import StorageEvents
from sessionkv.tiers.g3.io import BackendDown, Guard, Quarantine, Staging
from sessionkv.tiers.g3.layout import layout_for, pins_for
from sessionkv.tiers.g3.objects import G3Objects, Observer, _Lookups
from sessionkv.tiers.g3.spec import spec_identity

__all__ = [
    "SUM_SUFFIX",
    "BackendDown",
    "G3Tier",
    "Guard",
    "ObjectBackend",
    "Quarantine",
    "Staging",
    "address_of",
    "checksum",
]

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = init_logger(__name__)
# KV events: chunks announced stored at most, per G2 chunk (``StorageEvents``:
# past it the oldest are reported removed; vLLM's tracker keeps a payload each).
ANNOUNCED_PER_G2_CHUNK = 2
ABANDONED_WAIT_S = 5.0  # shutdown waits this long for abandoned calls
# A copy (a cascade job or a hint move's wave) goes to the backend in calls of
# at most this many bytes of chunks (one chunk at least). It bounds what a
# backend holds of ours per call: Redis' replies to one pipeline are all in
# memory at once (a wave of 65,536 x 2 MiB chunks in one call: 128 GiB), and
# each call's deadline stays that of a modest transfer.
BATCH_BYTES = 64 << 20


class G3Tier(G3Objects):
    """A vLLM secondary tier over an ``ObjectBackend`` (see the module docstring).

    A backend's tier is ``class XTier(G3Tier): backend_class = XBackend``: the
    tier config's keys not listed here go to ``backend_class(**keys)``."""

    medium: ClassVar[Medium] = Medium.STORAGE
    backend_class: ClassVar[type[ObjectBackend] | None] = None

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backend: ObjectBackend | None = None,
        namespace: str = "sessionkv",
        io_threads: int = 2,
        timeout_s: float = 2.0,
        retry_s: float = 1.0,
        backpressure_detector: BackpressureDetector | None = None,
        quarantine: Quarantine | None = None,
        observer: Observer | None = None,
        seal_key: bytes | None = None,
        **backend_config: Any,
    ):
        """``quarantine``: the G2 slots abandoned reads may still write (the
        primary tier's, in an engine; a tier's own otherwise). ``observer``:
        told of every copy as it ends, on an I/O thread. ``seal_key``: the
        cluster's G3 MAC key (``Seal``); None keeps the unkeyed checksum."""
        if backend is None:
            if self.backend_class is None:
                raise TypeError(f"{type(self).__name__} names no backend_class")
            backend = self.backend_class(**backend_config)
        try:
            self.quarantine = quarantine if quarantine is not None else Quarantine()
            self._observer = observer
            self._seal = Seal(seal_key)
            self.rejected = 0  # objects there but unreadable or failing their seal
            self._setup(
                offloading_spec,
                primary_kv_view,
                tier_type,
                backend,
                namespace,
                io_threads,
                timeout_s,
                retry_s,
                backpressure_detector,
            )
        except Exception:
            backend.close()
            raise

    def _setup(
        self,
        offloading_spec,
        primary_kv_view,
        tier_type,
        backend,
        namespace,
        io_threads,
        timeout_s,
        retry_s,
        backpressure_detector,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty name without '/', got {namespace!r}")
        for key, v in (("timeout_s", timeout_s), ("retry_s", retry_s), ("io_threads", io_threads)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{tier_type}: {key} must be a positive number, got {v!r}")
        self._chunk = primary_kv_view.strides[0]
        self._region = (
            primary_kv_view.cast("B")
            if (primary_kv_view.ndim > 1 or primary_kv_view.format != "B")
            else primary_kv_view
        )
        self._identity = {**spec_identity(offloading_spec, self._chunk), "seal": self._seal.id}
        self._namespace = namespace
        self._prefix: str | None = None
        self._backend = backend
        # Call threads for every copy thread of both pools (one call each at a
        # time), the lookup thread and the doctor: a busy permit trips the breaker.
        self.guard = Guard(
            tier_type, float(timeout_s), float(retry_s), threads=max(8, 2 * int(io_threads) + 2)
        )
        backend.register(self._region)
        backend.bind(namespace)
        self._layout = layout_for(backend, self.guard, self._chunk, self._seal, self.quarantine)
        self._pins = pins_for(backend, self.guard, self._layout, time.monotonic, self._region)
        self._pool = ThreadPoolExecutor(
            max_workers=int(io_threads), thread_name_prefix=f"sessionkv-{tier_type}"
        )
        # Hint copies have their own lane: a moved session's next turn waits
        # for its Share, which must not queue behind the write-through
        # cascades of every request the old engine is decoding.
        self._hint_pool = ThreadPoolExecutor(
            max_workers=int(io_threads), thread_name_prefix=f"sessionkv-{tier_type}-hint"
        )
        self._pending: set[Future] = set()  # vLLM's jobs
        # Hint copies and pins: outside vLLM's job table, they finish through
        # the Mover's wake-up of the control channel, so they must not keep an
        # idle engine stepping (``has_pending_work``), and a reset does not
        # wait for them (``drain_jobs``): they hold their G2 slots instead.
        self._hint_work: set[Future] = set()
        # (result, keys of a failed load, chunks of a cascade): collected by vLLM
        self._done: list[tuple[JobResult, list[OffloadKey], int]] = []
        # The default backpressure counts this tier's cascades (tiers/g3/backpressure.py).
        self._cascades = (
            backpressure_detector if isinstance(backpressure_detector, CascadeQueue) else None
        )
        # vLLM's KV events, when on: the chunks this tier stored and the
        # ones it learned are gone (``tiers/g3/events.py``), taken every step.
        events = getattr(offloading_spec, "kv_events_config", None)
        self._events = (
            StorageEvents(
                ANNOUNCED_PER_G2_CHUNK * (len(self._region) // self._chunk),
                getattr(backend, "lapse_s", None),
            )
            if events is not None and events.enable_kv_cache_events
            else None
        )
        self._failed: dict[str, float] = {}  # name -> until when it is a miss
        self._own: OrderedDict[int, None] = OrderedDict()  # hash(name): chunks vouched for, LRU
        self._lock = threading.Lock()
        self._lookups = _Lookups(self)

    # ---- vLLM's contract (scheduler thread) ------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._failed:
            name = self.name(key)
            with self._lock:
                until = self._failed.get(name)
                if until is not None:
                    if until > time.monotonic():
                        return LookupResult.MISS
                    del self._failed[name]
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        if self._cascades is not None:  # vLLM collected the cascades that ended
            self._cascades.step_ended()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        # vLLM's cascade: chunks this engine just computed, which another
        # engine has stored as well only in a race. Whether a second put is
        # harmless is the layout's (asking cost 7 % of an LMCache put of
        # 1 MiB chunks): ``Layout.cascade_asks``.
        if self._cascades is not None:
            self._cascades.entered(len(job_metadata.keys))
        self._submit(False, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(True, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        for _r, keys, cascaded in done:
            if keys:  # failed loads: no second promotion (vLLM #49176)
                self._lookups.mark_miss(keys)
            if cascaded and self._cascades is not None:
                self._cascades.left(cascaded)
        return [r for r, _, _ in done]

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks stored (vLLM's cascades and hint copies) and stored ones
        learned gone (``tiers/g3/events.py``), medium STORAGE."""
        if self._events is None:
            return ()
        return [
            OffloadingEvent(
                keys=keys,
                medium=self.medium,
                removed=removed,
                locality=self.locality,
                removal_expected=True,
            )
            for keys, removed in self._events.take()
        ]

    def has_pending_work(self) -> bool:
        """vLLM's jobs only (see ``_hint_work``)."""
        with self._lock:
            return bool(self._pending or self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Wait for vLLM's jobs (a reset: vLLM's tiering manager then forgets
        them). Hint copies go on; their G2 slots stay in the quarantine."""
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def drain_hints(self) -> None:
        """Wait for the hint copies and pins started so far."""
        with self._lock:
            pending = list(self._hint_work)
        wait(pending)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hint_pool.shutdown(wait=True, cancel_futures=True)
        self._pins.close()
        # An abandoned call may still write G2 or the checksum slots, unmapped next.
        until = time.monotonic() + ABANDONED_WAIT_S
        while self.guard.abandoned and time.monotonic() < until:
            time.sleep(0.05)
        if self.guard.abandoned:
            logger.warning(
                "sessionkv: G3 %s shutting down with %d backend calls still "
                "running past their deadline",
                self.tier_type,
                self.guard.abandoned,
            )
        self.guard.shutdown()
        self._backend.close()
        self._layout.close()
        self._region.release()  # else the primary tier cannot unmap G2

    def health(self) -> str:
        """ "" when the backend answers a lookup within the deadline, else why
        not (for ``sessionkv doctor``). Blocks its caller up to the deadline."""
        try:
            self.guard.call(self._backend.exists, [self.prefix + "sessionkv-doctor" + SUM_SUFFIX])
        except BackendDown as e:
            return str(e)
        return ""

    # ---- I/O threads ----------------------------------------------------------------

    def _submit(self, load: bool, job: TransferJob) -> None:
        keys = list(job.keys)
        names = [self.name(k) for k in keys]
        offsets = [int(c) * self._chunk for c in job.chunk_ids]
        fut = self._pool.submit(self._run, load, job.job_id, keys, names, offsets)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._finished)

    def _finished(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            self._hint_work.discard(fut)

    def _hint_job(self, run: Callable[[], None], slots: Sequence[int] | None) -> None:
        """``run()`` on the hint threads, the G2 ``slots`` it reads or writes
        held in the quarantine from now until it ended (``done`` included):
        a reset meanwhile keeps them out of G2's free list."""
        held = [int(c) for c in slots] if slots is not None else []
        self.quarantine.hold(held)

        def job():
            try:
                run()
            finally:
                self.quarantine.release(held)

        try:
            fut = self._hint_pool.submit(job)
        except BaseException:
            self.quarantine.release(held)
            raise
        with self._lock:
            self._hint_work.add(fut)
        fut.add_done_callback(self._finished)

    def _run(
        self, load: bool, job_id: int, keys: list[OffloadKey], names: list[str], offsets: list[int]
    ) -> None:
        start = time.monotonic()
        ok = self._copy(load, f"job {job_id}", keys, names, offsets, cascade=True)
        good = [k for k, o in zip(keys, ok) if o]
        failed_loads = [k for k, o in zip(keys, ok) if not o] if load else []
        result = JobResult(
            job_id=job_id,
            success=len(good) == len(keys),
            successful_keys=good if len(good) < len(keys) else None,
            transfer_time=time.monotonic() - start,
            transfer_bytes=len(good) * self._chunk,
        )
        with self._lock:
            self._done.append((result, failed_loads, 0 if load else len(keys)))
        if self._events is not None and not load:
            self._events.stored(good)

    def _copy(
        self,
        load: bool,
        what: str,
        keys: list[OffloadKey],
        names: list[str],
        offsets: list[int],
        cascade: bool = False,
    ) -> list[bool]:
        """One load, or a store (``cascade``: vLLM's, else a hint's; see
        ``_store``), in calls of at most ``BATCH_BYTES``; ok per key, never raises.
        Once the backend is down, the rest of the copy fails without a call."""
        step, ok = max(1, BATCH_BYTES // self._chunk), []
        for i in range(0, len(keys), step):
            part = slice(i, i + step)
            done, down = self._copy_batch(
                load, what, keys[part], names[part], offsets[part], cascade
            )
            ok += done
            if down:
                break
        rest = keys[len(ok) :]
        if rest:
            ok += [False] * len(rest)
            if self._observer is not None:
                self._observer(load, rest, [False] * len(rest))
        return ok

    # ---- copies and pins outside vLLM's job table (hints) ---------------------------

    @property
    def pin_needs_bytes(self) -> bool:
        """Whether ``pin`` needs the chunks' G2 slots (the backend rewrites them)."""
        return self._pins.needs_bytes

    def pin(
        self,
        keys: list[OffloadKey],
        ttl_s: float,
        chunk_ids: Sequence[int] | None,
        done: Callable[[list[bool]], None],
    ) -> None:
        """Keep chunks' objects (data and checksum) from the backend's eviction
        for ``ttl_s``, on the I/O threads: by the backend's own mechanism
        (``ObjectBackend.pin``), ended by the backend or here when it lapses.
        ``chunk_ids``: the chunks' G2 slots, reserved by the caller, when
        ``pin_needs_bytes``. ``done`` as for ``move``: ok per key, some
        pinned and some not where a slice failed. In slices of bounded
        calls (``tiers/g3/layout.Pins``); a rewriting pin reads G2 a slice
        at a time into a staging buffer of the tier's, so no pin copies the
        session in memory."""
        keys = list(keys)
        names = [self.name(k) for k in keys]
        slots = None if chunk_ids is None else [int(c) for c in chunk_ids]

        def run():
            try:
                ok = self._pins.pin(names, slots, ttl_s)
            except Exception:
                logger.exception("sessionkv: G3 pin failed")
                ok = [False] * len(keys)
            if self._events is not None:
                self._events.held([k for k, o in zip(keys, ok) if o], ttl_s)
            done(ok)

        self._hint_job(run, chunk_ids)

    def move(
        self,
        load: bool,
        keys: list[OffloadKey],
        chunk_ids: Sequence[int],
        done: Callable[[list[bool]], None],
        check: Sequence[OffloadKey] = (),
    ) -> None:
        """Copy chunks between their G2 slots (``chunk_ids``, reserved by the
        caller) and this tier on the I/O threads, outside vLLM's job table
        (Demote, Prefetch, Share): a load when ``load``, else a store.
        ``check``: chunks believed here already (a store's, with no G2 copy),
        asked for in the same job. ``done(ok per key, then listed per checked
        chunk)`` runs on an I/O thread when the copy ended, and must not wait
        for the tier manager's lock. The slots are held in the quarantine
        until ``done`` returned (``_hint_job``)."""
        keys, check = list(keys), list(check)
        names = [self.name(k) for k in keys]
        offsets = [int(c) * self._chunk for c in chunk_ids]

        def run():
            ok = self._copy(load, "move", keys, names, offsets) if keys else []
            if self._events is not None and not load:  # Demote, Share: KV events
                self._events.stored([k for k, o in zip(keys, ok) if o])
            done(ok + (self.listed(check) if check else []))

        self._hint_job(run, chunk_ids)
