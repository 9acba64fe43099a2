"""The offloading manager vLLM's connector calls: vLLM's own manager (its
tiering manager with G3 tiers, the G2 primary tier alone without:
``tiers/g2/tier.py``) with the session service (``engine/service.py``)
around it.

``SessionTierManager`` is a thin adapter: vLLM's calls go to ``vllm``, and
the few that change what hints wait for (stores, evictions, finished
requests, resets) tell ``service`` too. Everything else the engine does for
sessions is the service's.

Wiring (docs/design/architecture.md, "One composition root"):
``SessionTierSpec.get_manager`` builds the index, the quarantine, the event
log and the G3 copy queue first and hands them to the tiers and this adapter
as constructor arguments; the adapter builds the service the same way.
Nothing is set on a part after it was built.

Threading: the one lock is ``lock`` (vLLM 0.33's tiering manager lock, ours
on 0.32; the service's threading story). vLLM 0.32 calls managers on the
scheduler thread, where ``SessionTierConnector`` holds the lock from its
first scheduler-side call of a ``schedule()`` pass until
``build_connector_meta`` returns, and around its other scheduler-side calls;
so a chunk found by ``lookup`` cannot vanish before ``prepare_load``. Every
method here expects its caller to hold the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sessionkv.config import SessionKVConfig
from sessionkv.connectors.metrics import SessionStats
from sessionkv.engine.service import G3Copies, SessionService
from sessionkv.events import EventLog, Transfer
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers import compat
from sessionkv.tiers.g2.tier import SessionPrimaryTier
from sessionkv.tiers.g3.tier import G3Tier
from sessionkv.types import Tier, TierName

# Tier names as events and stats carry them, read once: an enum member's
# ``name`` is a property call (two per G1 -> G2 store, 16 stores a decode step).
_G1: TierName = Tier.G1.name
_G2: TierName = Tier.G2.name


class VllmTiering(compat.CascadeGate, compat.ParkedCascades, TieringOffloadingManager):
    """vLLM's tiering manager over G2 and the G3 tiers, cascading G2 -> G3
    only with ``g3.write_through``."""

    def __init__(
        self,
        primary_tier: SessionPrimaryTier,
        secondary_tiers: list[SecondaryTierManager],
        write_through: bool,
        **vllm_kwargs,
    ):
        super().__init__(primary_tier=primary_tier, secondary_tiers=secondary_tiers, **vllm_kwargs)
        self._write_through = write_through

    def cascades(self) -> bool:
        # g3.write_through false: vLLM's cascade sends nothing down; hints do.
        return self._write_through


class SessionTierManager(OffloadingManager):
    """vLLM's manager (``vllm``) with the session service (``service``)
    around it.

    ``vllm`` is vLLM's tiering manager when there are G3 tiers, and the G2
    primary tier alone when there are none, as vLLM's own CPU spec runs it:
    the tiering layer's per-call work there is bookkeeping for cascades that
    cannot happen (docs/design/architecture.md).

    Lock rule: the scheduler thread holds ``lock`` for each ``schedule()``
    pass (first scheduler-side connector call until ``build_connector_meta``
    returns) and around its other calls; other threads go through
    ``service``, which takes it."""

    def __init__(
        self,
        primary_tier: SessionPrimaryTier,
        secondary_tiers: list[SecondaryTierManager],
        index: SessionPrefixIndex,
        config: SessionKVConfig,
        g3_copies: G3Copies,
        event_log: EventLog | None,
        **vllm_kwargs,
    ):
        """``g3_copies``: the queue every G3 tier observes into; ``event_log``:
        the primary tier's too (None: no event stream); ``vllm_kwargs``: what
        the running vLLM's tiering manager takes besides (``compat.manager_kwargs``)."""
        self.primary_tier = primary_tier
        self.secondary_tiers = secondary_tiers
        self.vllm: OffloadingManager = (
            VllmTiering(
                primary_tier, secondary_tiers, config.policy.g3.write_through, **vllm_kwargs
            )
            if secondary_tiers
            else primary_tier
        )
        self._lock = compat.manager_lock(self.vllm)
        self.index = index
        self.event_log = event_log
        self.stats = SessionStats(
            primary_tier.get_kv_memoryview().strides[0], primary_tier.blocks_per_chunk
        )
        # G1 <-> G2 chunks copied since the last ``get_stats``, (src, dst) ->
        # chunks, counted under the lock rather than under the stats' own
        # (a decode step stores a block of every 16th request).
        self._copied: dict[tuple[str, str], int] = {}
        g3 = [t for t in secondary_tiers if isinstance(t, G3Tier)]
        self.service = SessionService(
            primary_tier,
            g3[0] if g3 else None,
            index,
            config,
            g3_copies,
            event_log,
            self.stats,
            self.lock,
        )
        self._executor = self.service.executor  # read on every store (complete_store)

    @property
    def lock(self) -> threading.Lock:
        """The one lock: vLLM's tiering manager's on 0.33 (a property of
        vLLM's ``OffloadingManager`` there), ours otherwise."""
        return self._lock

    def shutdown(self) -> None:
        self.service.drain()
        self.vllm.shutdown()
        self.service.close()

    def get_stats(self):
        """vLLM's offloading stats, with sessionkv's (``connectors.metrics``)."""
        copied, self._copied = self._copied, {}
        return self.stats.take(
            len(self.index),
            self.index.num_sessions,
            self.service.executor.pinned_chunks,
            {t.tier_type: t.rejected for t in self.secondary_tiers if isinstance(t, G3Tier)},
            into=self.vllm.get_stats(),
            copied=copied,
        )

    def reset_cache(self) -> None:
        # vLLM's reset waits for its own jobs (drain_jobs); hint copies are
        # abandoned instead (SessionService.before_reset). 0.32 has no fence
        # after the reset (engine/mover.py, "Reset").
        self.service.before_reset()
        self.vllm.reset_cache()
        self.service.after_reset(compat.VLLM_FENCES_RESETS)

    # vLLM's manager interface: ``vllm`` does the work; G1 <-> G2 copies that
    # end are counted here too.

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self.vllm.lookup(key, req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return self.vllm.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self.vllm.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.vllm.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.vllm.complete_load(keys, req_context)
        self._transferred(_G2, _G1, keys, True, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = self.vllm.prepare_store(keys, req_context)
        if out is not None and out.evicted_keys:
            self.service.evicted(out.evicted_keys)
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.vllm.complete_store(keys, req_context, success)
        self._transferred(_G1, _G2, keys, success, req_context)
        if self._executor.waiting:  # a decode step stores a block of every 16th request
            self.service.stored(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.vllm.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM prepared the request's last stores (or it had none).
        self.vllm.on_request_finished(req_context)
        self.service.request_finished(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.vllm.take_events()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.vllm.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.vllm.has_pending_work()

    def on_reset_flushed(self) -> None:  # vLLM 0.33
        self.vllm.on_reset_flushed()
        self.service.reset_flushed()

    def config_info(self):  # vLLM 0.33
        return self.vllm.config_info()

    def _transferred(
        self,
        src: TierName,
        dst: TierName,
        keys: Collection[OffloadKey],
        ok: bool,
        req_context: ReqContext,
    ) -> None:
        """A G1<->G2 copy ended (tier names): counted, and logged when there is
        a log. Without one no event is built (a decode step stores a block of
        every 16th request)."""
        if self.event_log is not None:
            self.service.emit(
                Transfer(src=src, dst=dst, keys=list(keys), ok=ok, req_id=req_context.req_id)
            )
        elif ok:
            pair = (src, dst)
            self._copied[pair] = self._copied.get(pair, 0) + len(keys)
