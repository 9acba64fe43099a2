"""G2: vLLM's CPU primary tier, keeping the SessionPrefixIndex in step with
its residency.

``SessionPrimaryTier`` reports every change of G2 residency to the index, from
the exact sources: ``PrepareStoreOutput.evicted_keys`` of every store and
promotion into G2 (both go through ``prepare_store``; ``prepare_write`` is its
alias), and the primary tier's own state after ``complete_store`` (a failed
store removes the chunks it had not marked stored). G2 keys name chunks by
their last block; the index holds blocks, so each chunk key stands for that
block and its ``blocks_per_chunk - 1`` ancestors. It also keeps the index's
knowledge of G3 copies bounded (``G3_KNOWN_PER_G2_CHUNK``).

G2 slots that a G3 load abandoned past its deadline may still write stay
out of the free list until that load ends (``QuarantinedPrimaryTier``, G2
when there are G3 tiers: its ``quarantine`` is shared with every G3 tier;
``tiers/g3/io.Quarantine``).

Threading: called under ``SessionTierManager.lock`` (``connectors/manager.py``).

Events (``sessionkv.events``): residency and eviction, appended to the event
log when the engine has one.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Collection, Sequence

from vllm.v1.kv_offload.base import OffloadKey, PrepareStoreOutput, ReqContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

from sessionkv.events import EventLog, Eviction, Residency
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers import compat
from sessionkv.tiers.g3.tier import Quarantine
from sessionkv.types import Tier

# The index counts a G3 copy for at most this many chunks per G2 chunk, the
# most recently seen first. Backends evict on their own and never say so:
# without a bound every block that ever reached G3 stayed indexed for ever
# (about 250 bytes a block). Twice G2 keeps index memory within a small
# multiple of what G2 holds; a chunk forgotten is still found by vLLM's own
# G3 lookups, only hints no longer name it.
G3_KNOWN_PER_G2_CHUNK = 2


class SessionPrimaryTier(CPUPrimaryTierOffloadingManager):
    """vLLM's CPU primary tier (G2) that reports residency to the index.
    Called under ``SessionTierManager.lock`` (see the module docstring)."""

    @property
    def policy(self):
        """The G2 cache policy vLLM built (``SessionCachePolicy`` by default)."""
        return compat.cpu_policy(self)

    def __init__(
        self,
        *args,
        num_chunks: int,
        index: SessionPrefixIndex,
        blocks_per_chunk: int,
        event_log: EventLog | None,
        mmap_region: SharedOffloadRegion,
        **kwargs,
    ):
        super().__init__(*args, num_chunks=num_chunks, mmap_region=mmap_region, **kwargs)
        self._region_path: str | None = getattr(mmap_region, "mmap_path", None)
        self._chunks = num_chunks
        self._index = index
        self._bpc = blocks_per_chunk
        self.event_log = event_log  # vLLM's own list is ``events``
        self._chunk = compat.cpu_policy(self).get  # vLLM builds its policy once
        self._g3_known: OrderedDict[OffloadKey, None] = OrderedDict()  # oldest first
        self._g3_cap = G3_KNOWN_PER_G2_CHUNK * num_chunks
        # A chunk of one block is its own key in the index: the index's own
        # ``set_copies``, without a call between (two a decode step's store).
        self._index_copies = index.set_copies if blocks_per_chunk == 1 else self._chain_copies

    @property
    def blocks_per_chunk(self) -> int:
        return self._bpc

    def shutdown(self) -> None:
        super().shutdown()
        # vLLM unlinks the region's /dev/shm file only from the process that
        # created it (the worker's), and only on its own clean shutdown, which
        # a server stopped with SIGTERM does not reach: the file (G2's whole
        # size) outlived every stopped engine. Every mapping still open keeps
        # its memory, so unlinking here, after the tiers stopped, is safe.
        if self._region_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._region_path)

    @property
    def num_chunks(self) -> int:
        """G2's size in chunks."""
        return self._chunks

    @property
    def index(self) -> SessionPrefixIndex:
        return self._index

    def set_copies(self, tier: Tier, chunk_keys: Sequence[OffloadKey], copies: int) -> None:
        """Index the copies in ``tier`` of every block these chunks hold. G3
        copies are known for the ``G3_KNOWN_PER_G2_CHUNK`` x G2 chunks seen
        last: recording more forgets the oldest."""
        if not chunk_keys:
            return
        if tier is Tier.G3:
            chunk_keys = self._g3_record(chunk_keys, copies)
        self._index_copies(tier, chunk_keys, copies)

    def _g3_record(self, chunk_keys: Collection[OffloadKey], copies: int) -> list[OffloadKey]:
        """Record ``chunk_keys``' G3 copies as known (``copies`` > 0) or not;
        the ones whose count the caller then sets. Past the bound, the oldest
        known are forgotten here (count 0), new ones included when one call
        records more than the bound holds."""
        known = self._g3_known
        if not copies:
            for k in chunk_keys:
                known.pop(k, None)
            return list(chunk_keys)
        for k in chunk_keys:
            known.pop(k, None)
            known[k] = None
        over = len(known) - self._g3_cap
        if over <= 0:
            return list(chunk_keys)
        forgotten = [known.popitem(last=False)[0] for _ in range(over)]
        self._index_copies(Tier.G3, forgotten, 0)
        return [k for k in chunk_keys if k in known]

    def _chain_copies(self, tier: Tier, chunk_keys: Collection[OffloadKey], copies: int) -> None:
        """``_index_copies`` of chunks of several blocks: each chunk's blocks."""
        self._index.set_copies(
            tier, [b for k in chunk_keys for b in self._index.chain_to(k, self._bpc)], copies
        )

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, req_context)
        if out is not None and out.evicted_keys:
            self._index_copies(Tier.G2, out.evicted_keys, 0)
            if self.event_log is not None:
                self.event_log.append(Eviction(tier=Tier.G2.name, keys=list(out.evicted_keys)))
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        super().complete_store(keys, req_context, success)
        # ``lookup``'s answer per key, read from the policy directly (HIT:
        # present and ready; MISS: absent; pending ones are neither).
        get = self._chunk
        stored, dropped = [], []
        for k in keys:
            chunk = get(k)
            if chunk is None:
                dropped.append(k)
            elif chunk.is_ready:
                stored.append(k)
        if stored:
            self._index_copies(Tier.G2, stored, 1)
        if dropped:
            self._index_copies(Tier.G2, dropped, 0)
        if self.event_log is not None:
            for ks, present in ((stored, True), (dropped, False)):
                if ks:
                    self.event_log.append(Residency(tier=Tier.G2.name, keys=ks, present=present))

    def reset_cache(self) -> None:
        super().reset_cache()
        self._index.clear_tier(Tier.G2)
        if self.event_log is not None:  # no keys: everything in the tier
            self.event_log.append(Eviction(tier=Tier.G2.name, keys=[], reason="reset"))


class QuarantinedPrimaryTier(compat.QuarantinedSlots, SessionPrimaryTier):
    """G2 under G3 tiers: slots a G3 load may still write stay out of its
    free list until released (``compat.QuarantinedSlots``). Without G3
    nothing can hold a slot, and vLLM's allocator runs without these hooks
    (three calls a store)."""

    def __init__(self, *args, quarantine: Quarantine, **kwargs):
        super().__init__(*args, **kwargs)
        self.quarantine = quarantine

    def reset_cache(self) -> None:
        super().reset_cache()
        held = self.quarantine.reset()
        if held:
            self._leave_out(held, self.num_chunks)
