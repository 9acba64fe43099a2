"""SessionCachePolicy: vLLM's LRU policy for G2, biased by Pin and Retain.

Eviction order, for ``evict(n, protected)``:

1. chunks neither pinned nor retained (or retained at priority 0): plain LRU,
   so un-hinted traffic evicts exactly as vLLM's ``LRUCachePolicy``;
2. retained chunks, lowest priority first, least recently used first within a
   priority;
3. pinned chunks only when nothing else is left: the oldest pins are clipped
   (``take_clipped()`` hands them to the hint executor for its outcomes), so
   pins never stall a store.

Pins and retains carry an expiry; lapsed ones are dropped lazily. The policy
never drops a chunk itself: every eviction runs through vLLM's LRU ``evict()``
(the chosen chunks are the only unprotected ones), which keeps the heap, the
free list and the counters right, and keeps ``evict`` atomic.

vLLM builds policies as ``cls(cache_capacity=n)`` (``eviction_policy`` +
``cache_policy_module_path``); the limits live in the hint executor, which
calls ``pin``/``retain`` here.

Threading: called by vLLM's CPU manager on the scheduler thread, and by hint
code holding the tier manager's lock; not thread-safe on its own.
"""

from __future__ import annotations

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
        self._clipped: list[OffloadKey] = []

    # ------------------------------------------------------------------ hints

    def pin(self, keys: Iterable[OffloadKey], ttl_s: float) -> int:
        """Protect present chunks until now + ttl_s; how many were pinned."""
        now = self.clock()
        n = 0
        for k in keys:
            if k in self.chunks:
                pinned_at = self._pins.get(k, (now, 0.0))[0]
                self._pins[k] = (pinned_at, now + ttl_s)
                n += 1
        return n

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            self._pins.pop(k, None)

    def retain(self, keys: Iterable[OffloadKey], priority: int, ttl_s: float | None,
               owner: str | None = None) -> int:
        """Order present chunks after lower priorities (until now + ttl_s), on
        behalf of ``owner`` (a session); how many."""
        expiry = float("inf") if ttl_s is None else self.clock() + ttl_s
        n = 0
        for k in keys:
            if k in self.chunks:
                self._retains[k] = (priority, expiry, owner)
                n += 1
        return n

    def release_retains(self, owner: str) -> int:
        """Drop the retains ``owner`` set last (its session ended); how many."""
        mine = [k for k, (_, _, o) in self._retains.items() if o == owner]
        for k in mine:
            del self._retains[k]
        return len(mine)

    def pinned(self) -> set[OffloadKey]:
        self._expire()
        return set(self._pins)

    def take_clipped(self) -> list[OffloadKey]:
        """Pinned chunks evicted because nothing else was left, since the last call."""
        out, self._clipped = self._clipped, []
        return out

    def _expire(self) -> None:
        now = self.clock()
        for k in [k for k, (_, exp) in self._pins.items() if exp <= now]:
            del self._pins[k]
        for k in [k for k, (_, exp, _) in self._retains.items() if exp <= now]:
            del self._retains[k]

    # ------------------------------------------------------- vLLM's contract

    def remove(self, key: OffloadKey) -> None:
        super().remove(key)
        self._pins.pop(key, None)
        self._retains.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self._pins.clear()
        self._retains.clear()

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        self._expire()
        biased = {k for k, (p, _, _) in self._retains.items() if p > 0} | self._pins.keys()
        if not biased:
            return super().evict(n, protected)
        # 1. plain LRU among the unbiased chunks
        got = super().evict(n, protected | biased)
        if got is not None:
            return got
        # 2./3. not enough: choose by order, then evict exactly those through LRU
        free = [k for k in self._evictable if k not in protected]
        rank = self._ranks.__getitem__
        plain = sorted((k for k in free if k not in biased), key=rank)
        retained = sorted((k for k in free if k in biased and k not in self._pins),
                          key=lambda k: (self._retains[k][0], rank(k)))
        pins = sorted((k for k in free if k in self._pins),
                      key=lambda k: (self._pins[k][0], rank(k)))
        chosen = (plain + retained + pins)[:n]
        if len(chosen) < n:
            return None
        keep = self._evictable - set(chosen)
        got = super().evict(n, protected | keep)
        if got is None:         # cannot happen: exactly n chosen keys are unprotected
            return None
        for k, _ in got:
            if self._pins.pop(k, None) is not None:
                self._clipped.append(k)
            self._retains.pop(k, None)
        return got
