"""Scheduler-side managers: vLLM's tiering managers, keeping the
SessionPrefixIndex in step with G2.

``SessionTierManager`` owns the index (one owner of mutable state).
``SessionPrimaryTier`` reports every change of G2 residency to it, from the
exact sources: ``PrepareStoreOutput.evicted_keys`` of every store and promotion
into G2 (both go through ``prepare_store``; ``prepare_write`` is its alias), and
the primary tier's own state after ``complete_store`` (a failed store removes
the chunks it had not marked stored). G2 keys name chunks by their last block;
the index holds blocks, so each chunk key stands for that block and its
``blocks_per_chunk - 1`` ancestors.

Threading (DESIGN.md, "Threads"): ``SessionTierManager.lock`` is the one lock.
vLLM 0.32 calls managers on the scheduler thread, where ``SessionTierConnector``
holds the lock from its first scheduler-side call of a ``schedule()`` pass
until ``build_connector_meta`` returns, and around its other scheduler-side
calls; so a chunk found by ``lookup`` cannot vanish before ``prepare_load``.
Every other thread takes the lock and only changes metadata (pins, priorities,
TTLs, session ends): never evicts, allocates or calls ``lookup``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from sessionkv.hints import HintOutcome, KvHint, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.types import Tier

from .hint_executor import HintExecutor, read_request_hints

logger = init_logger(__name__)


class SessionPrimaryTier(CPUPrimaryTierOffloadingManager):
    """vLLM's CPU primary tier (G2) that reports residency to the index.
    Called under ``SessionTierManager.lock`` (see the module docstring)."""

    @property
    def policy(self):
        """The G2 cache policy vLLM built (``SessionCachePolicy`` by default)."""
        return self._policy

    def __init__(self, *args, index: SessionPrefixIndex, blocks_per_chunk: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._index = index
        self._bpc = blocks_per_chunk

    def _set_g2(self, chunk_keys: Collection[OffloadKey], copies: int) -> None:
        if not chunk_keys:
            return
        if self._bpc == 1:
            blocks = list(chunk_keys)
        else:
            blocks = [b for k in chunk_keys for b in self._index.chain_to(k, self._bpc)]
        self._index.set_copies(Tier.G2, blocks, copies)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, req_context)
        if out is not None:
            self._set_g2(out.evicted_keys, 0)
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        super().complete_store(keys, req_context, success)
        stored, dropped = [], []
        for k in keys:
            hit = self.lookup(k, req_context)
            if hit is LookupResult.HIT:
                stored.append(k)
            elif hit is LookupResult.MISS:
                dropped.append(k)
        self._set_g2(stored, 1)
        self._set_g2(dropped, 0)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._index.clear_tier(Tier.G2)


class RequestHints(tuple):
    """A request's hints, parsed once (``ReqContext`` state): ``KvHint``s and
    the ``rejected`` outcomes of actions that did not parse."""


class SessionTierManager(TieringOffloadingManager):
    """vLLM's tiering manager that owns the lock, the SessionPrefixIndex and
    the HintExecutor, and parses each request's hints once.

    Lock rule: the scheduler thread holds ``lock`` for each ``schedule()``
    pass (first scheduler-side connector call until ``build_connector_meta``
    returns) and around its other calls; any other thread takes ``lock`` and
    only changes metadata through ``executor``."""

    def __init__(
        self,
        primary_tier: SessionPrimaryTier,
        secondary_tiers: list[SecondaryTierManager],
        index: SessionPrefixIndex,
        executor: HintExecutor,
        secret: bytes | None,
    ):
        super().__init__(primary_tier=primary_tier, secondary_tiers=secondary_tiers)
        self.lock = threading.RLock()
        self.index = index
        self.executor = executor
        self._secret = secret
        # req_id -> (session, hints) until the request finishes
        self._request_hints: dict[str, tuple[str | None, RequestHints]] = {}

    def on_new_request(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> RequestOffloadingContext:
        ctx = super().on_new_request(req_context, exclude_tier_idx=exclude_tier_idx)
        if exclude_tier_idx is None:        # a request, not a tier's own job
            params = req_context.kv_transfer_params or {}
            session = params.get("session_id")
            session = session if isinstance(session, str) else None
            try:
                hints = RequestHints(read_request_hints(
                    params, req_context.kv_hints, session, self._secret))
            except Exception:       # a parser bug must cost one hint, never the engine
                logger.exception("sessionkv: hints of request %s unreadable", req_context.req_id)
                hints = RequestHints([HintOutcome("kv_hints", None, Status.REJECTED,
                                                  reason="internal error reading hints")])
            if hints:
                req_context.set_state(hints)
                self._request_hints[req_context.req_id] = (session, hints)
        return ctx

    def finish_request_hints(self, req_id: str) -> tuple[HintOutcome, ...]:
        """Execute a finished request's hints: one outcome each."""
        session, hints = self._request_hints.pop(req_id, (None, RequestHints()))
        items: list[KvHint | HintOutcome] = list(hints)
        try:
            return tuple(self.executor.execute_all(items, session))
        except Exception:           # an executor bug must cost the hints, never the engine
            logger.exception("sessionkv: hints of request %s failed", req_id)
            return tuple(i if isinstance(i, HintOutcome) else HintOutcome(
                i.hint_id, f"kv.{i.action.value}", Status.REJECTED, reason="internal error")
                for i in items)

    def on_request_finished(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> None:
        self._request_hints.pop(req_context.req_id, None)
        super().on_request_finished(req_context, exclude_tier_idx=exclude_tier_idx)
