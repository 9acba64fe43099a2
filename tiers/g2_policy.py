"""SessionCachePolicy: vLLM's LRU policy for G2, biased by Pin and Retain.

Eviction order, for ``evict(n, protected)``:

1. chunks neither pinned nor retained (or retained at priority 0): plain LRU,
   so un-hinted traffic evicts exactly as vLLM's ``LRUCachePolicy``; demoted
   chunks (``demote``: a Demote hint copied them to G3) before all others;
2. retained chunks, lowest priority first, least recently used first within a
   priority;
3. pinned chunks only when nothing else is left: the oldest pins are clipped
   (``take_clipped()`` hands them to the hint executor for its outcomes), so
   pins never stall a store.

Pins and retains carry an expiry; lapsed ones are dropped lazily. Every pin
that ends other than by ``unpin`` or a clip (it lapsed, its chunk was removed
or demoted, a reset) is handed out once by ``take_unpinned()``, so the hint
executor keeps its pin book without a pass over all pins; it drains the set
every step, which bounds it. The policy
never drops a chunk itself: every eviction runs through vLLM's LRU ``evict()``
(the chosen chunks are the only unprotected ones), which keeps the heap, the
free list and the counters right, and keeps ``evict`` atomic.

Cost: biased chunks (pinned, or retained at a priority above 0) are kept out
of LRU's evictable set (in ``_held``) while they are biased, so an ordinary
eviction never walks past them: with most of G2 biased, a store costs what
vLLM's LRU costs, not a pass over the whole heap. They rejoin LRU's evictable
set, with their current recency, when the bias lapses or when they are chosen.

vLLM builds policies as ``cls(cache_capacity=n)`` (``eviction_policy`` +
``cache_policy_module_path``); the limits live in the hint executor, which
calls ``pin``/``retain`` here.

Threading: called by vLLM's CPU manager on the scheduler thread, and by hint
code holding the tier manager's lock; not thread-safe on its own.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


class SessionCachePolicy(LRUCachePolicy):
    """LRU with pins (protected until their TTL) and retains (ordered by priority)."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._pins: dict[OffloadKey, tuple[float, float]] = {}    # key -> (pinned_at, expiry)
        # key -> (priority, expiry, owner)
        self._retains: dict[OffloadKey, tuple[int, float, str | None]] = {}
        self._owned: dict[str, set[OffloadKey]] = {}     # owner -> the keys it retains
        self._clipped: list[OffloadKey] = []
        self._unpinned: set[OffloadKey] = set()         # see take_unpinned
        # Biased chunks with ref_cnt 0, kept out of LRU's ``_evictable``.
        self._held: set[OffloadKey] = set()
        # (expiry, key) of every pin and retain set, lazily invalidated: lapses
        # are found without a pass over all hints on every eviction.
        self._expiries: list[tuple[float, OffloadKey]] = []
        self._demoted = 0               # ranks of demoted chunks count down from here
        self._demoted_keys: set[OffloadKey] = set()

    def _track(self, expiry: float, k: OffloadKey) -> None:
        if expiry != float("inf"):
            heapq.heappush(self._expiries, (expiry, k))

    def _biased(self, k: OffloadKey) -> bool:
        r = self._retains.get(k)
        return k in self._pins or (r is not None and r[0] > 0)

    def _sync(self, k: OffloadKey) -> None:
        """Move ``k`` between LRU's evictable set and ``_held`` after its bias changed."""
        if self._biased(k):
            if k in self._evictable:
                self._evictable.remove(k)      # its heap entries lapse lazily
                self._held.add(k)
        elif k in self._held:
            self._held.remove(k)
            super().mark_evictable(k)          # back in the heap at its current rank

    # ------------------------------------------------------------------ hints

    def pin(self, keys: Iterable[OffloadKey], ttl_s: float) -> int:
        """Protect present chunks until now + ttl_s; how many were pinned."""
        now = self.clock()
        n = 0
        for k in keys:
            if k in self.chunks:
                pinned_at = self._pins.get(k, (now, 0.0))[0]
                self._pins[k] = (pinned_at, now + ttl_s)
                self._unpinned.discard(k)
                self._track(now + ttl_s, k)
                self._sync(k)
                n += 1
        return n

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            if self._pins.pop(k, None) is not None:
                self._sync(k)

    def retain(self, keys: Iterable[OffloadKey], priority: int, ttl_s: float | None,
               owner: str | None = None) -> int:
        """Order present chunks after lower priorities (until now + ttl_s), on
        behalf of ``owner`` (a session); how many."""
        expiry = float("inf") if ttl_s is None else self.clock() + ttl_s
        n = 0
        for k in keys:
            if k in self.chunks:
                self._drop_retain(k)
                self._retains[k] = (priority, expiry, owner)
                if owner is not None:
                    self._owned.setdefault(owner, set()).add(k)
                self._track(expiry, k)
                self._sync(k)
                n += 1
        return n

    def release_retains(self, owner: str) -> int:
        """Drop the retains ``owner`` set last (its session ended); how many."""
        mine = self._owned.pop(owner, set())
        for k in mine:
            del self._retains[k]
            self._sync(k)
        return len(mine)

    def _drop_retain(self, k: OffloadKey) -> bool:
        """Forget ``k``'s retain (and its owner's claim); whether it had one."""
        ret = self._retains.pop(k, None)
        if ret is None:
            return False
        owner = ret[2]
        if owner is not None:
            mine = self._owned.get(owner)
            if mine is not None:
                mine.discard(k)
                if not mine:
                    del self._owned[owner]
        return True

    def demote(self, keys: Iterable[OffloadKey]) -> int:
        """Make these chunks the first to go (a Demote hint: their G3 copy
        exists), the last of ``keys`` first; their pins and retains end. They
        stay first until a request uses them again (vLLM finishing the
        request that stored them is no use). How many are in G2."""
        n = 0
        for k in keys:
            if k not in self.chunks:
                continue
            self._demoted_keys.add(k)
            self._lose_pin(k)
            self._drop_retain(k)
            self._sync(k)
            self._demoted -= 1                 # below every rank LRU assigns
            self._ranks[k] = self._demoted
            if k in self._evictable:
                self._push_evictable(k)
            n += 1
        return n

    def pinned(self) -> set[OffloadKey]:
        self._expire()
        return set(self._pins)

    def take_unpinned(self) -> set[OffloadKey]:
        """Chunks whose pin ended since the last call, other than by
        ``unpin`` or a clip (``take_clipped``): lapsed, removed, demoted, reset."""
        self._expire()
        out, self._unpinned = self._unpinned, set()
        return out

    def _lose_pin(self, k: OffloadKey) -> None:
        if self._pins.pop(k, None) is not None:
            self._unpinned.add(k)

    def pin_expiry(self, key: OffloadKey) -> float | None:
        """When ``key``'s pin lapses (the policy's clock), or None when unpinned."""
        pin = self._pins.get(key)
        return None if pin is None else pin[1]

    def take_clipped(self) -> list[OffloadKey]:
        """Pinned chunks evicted because nothing else was left, since the last call."""
        out, self._clipped = self._clipped, []
        return out

    def _expire(self) -> None:
        now = self.clock()
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, k = heapq.heappop(heap)
            pin, ret = self._pins.get(k), self._retains.get(k)
            changed = False
            if pin is not None and pin[1] <= now:
                self._lose_pin(k)
                changed = True
            if ret is not None and ret[1] <= now:
                self._drop_retain(k)
                changed = True
            if changed:
                self._sync(k)
        if len(heap) > 2 * (len(self._pins) + len(self._retains)) + 64:
            self._expiries = [(e, k) for k, (_, e) in self._pins.items()]
            self._expiries += [(e, k) for k, (_, e, _) in self._retains.items()
                               if e != float("inf")]
            heapq.heapify(self._expiries)

    # ------------------------------------------------------- vLLM's contract

    def touch(self, keys: Iterable[OffloadKey], req_context) -> None:
        keys = list(keys)
        self._demoted_keys.difference_update(keys)
        super().touch(keys, req_context)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys,
                            req_context) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        if self._demoted_keys:
            # The request that stored demoted chunks may finish after the
            # Demote (vLLM waits for its stores): it does not make them recent.
            self._demoted_keys.difference_update(reused_keys)
            self.demote([k for g in key_groups for k in g if k in self._demoted_keys])

    def remove(self, key: OffloadKey) -> None:
        super().remove(key)
        self._demoted_keys.discard(key)
        self._held.discard(key)
        self._lose_pin(key)
        self._drop_retain(key)

    def clear(self) -> None:
        super().clear()
        self._demoted_keys.clear()
        self._held.clear()
        self._expiries.clear()
        self._unpinned.update(self._pins)
        self._pins.clear()
        self._retains.clear()
        self._owned.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        if self._biased(key):
            self._held.add(key)
        else:
            super().mark_evictable(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key in self._held:
            self._held.remove(key)
        else:
            super().mark_non_evictable(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        self._expire()
        # 1. plain LRU among the unbiased chunks (the only ones LRU sees)
        got = super().evict(n, protected)
        if got is not None or not self._held:
            return got
        # 2./3. not enough: every plain chunk goes, then retained ones by
        # priority and recency, then the oldest pins; evict exactly those
        # through LRU, the chosen biased ones rejoining its evictable set.
        rank = self._ranks.__getitem__
        plain = [k for k in self._evictable if k not in protected]
        held = [k for k in self._held if k not in protected]
        retained = sorted((k for k in held if k not in self._pins),
                          key=lambda k: (self._retains[k][0], rank(k)))
        pins = sorted((k for k in held if k in self._pins),
                      key=lambda k: (self._pins[k][0], rank(k)))
        chosen = (retained + pins)[:n - len(plain)]
        if len(plain) + len(chosen) < n:
            return None
        for k in chosen:
            self._held.remove(k)
            super().mark_evictable(k)
        got = super().evict(n, protected)
        if got is None:         # cannot happen: exactly n keys are unprotected
            return None
        for k, _ in got:
            if self._pins.pop(k, None) is not None:
                self._clipped.append(k)
            self._drop_retain(k)
        return got
