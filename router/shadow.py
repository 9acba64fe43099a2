"""Shadow caches: how each candidate strategy would have done on one engine.

The router cannot try two strategies on one engine at once, so, the way ARC,
LeCaR and Cacheus adapt, it replays its own request stream through one small
model of the engine's G2 per strategy (``ShadowCache``) and follows the one
that would have hit the most (``Selector``). A shadow is what the engine's
``SessionCachePolicy`` does with the hints that strategy would send: plain
blocks (priority 0) go first, then lower priorities, least recently used
first within one; in front of it an LRU G1 (vLLM's prefix cache), which is
why a strategy may leave what G1 still holds to G1; a request hits its
leading blocks resident in either.

Sampling: a shadow of an engine with more than ``max_blocks`` blocks of G2
holds only the keys whose hash falls in a fixed fraction ``rate``, with
``rate`` times the capacity, and scales its hits back up (SHARDS, Waldspurger
et al., FAST'15): the cost per request and the memory stay bounded at any G2
size.

Cost: a request costs O(its sampled blocks + the blocks it evicts) per
shadow; an eviction finds the lowest non-empty priority in O(log levels).
Memory: at most ``max_blocks`` keys per shadow. Not thread-safe: the policy
that owns the shadows calls them from one thread (the router's event loop).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

_SPACE = 1 << 32


def sampled(key: bytes, rate: float) -> bool:
    """Whether ``key`` is in a shadow sampled at ``rate`` (by its hash bytes:
    engine keys are hashes already)."""
    return rate >= 1.0 or int.from_bytes(key[:4], "big") < rate * _SPACE


class ShadowCache:
    """One strategy's model of one engine's G2 (see the module docstring)."""

    def __init__(self, capacity_blocks: int, g1_blocks: int = 0, max_blocks: int = 65_536):
        if capacity_blocks < 1 or g1_blocks < 0:
            raise ValueError("a shadow cache needs a G2 of at least one block and a G1 >= 0")
        self.rate = min(1.0, max_blocks / (capacity_blocks + g1_blocks))
        self.capacity = max(1, int(capacity_blocks * self.rate))
        self.g1_capacity = int(g1_blocks * self.rate)
        self._g1: OrderedDict[bytes, None] = OrderedDict()
        self._prio: dict[bytes, int] = {}
        self._buckets: dict[int, OrderedDict[bytes, None]] = {}
        self._levels: list[int] = []          # sorted priorities with a non-empty bucket

    def __len__(self) -> int:
        return len(self._prio)

    def keys_of(self, keys: Iterable[bytes]) -> list[bytes]:
        """The sampled ones of ``keys``, in order."""
        rate = self.rate
        return list(keys) if rate >= 1.0 else [k for k in keys if sampled(k, rate)]

    def request(self, keys: Sequence[bytes]) -> float:
        """Serve a request's sampled ``keys``: its leading resident run (scaled
        to all keys), then every key resident and most recent at its priority
        (new ones plain), room made among the other blocks."""
        g1, prio = self._g1, self._prio
        a = 0                              # G1's leading run, then G2's
        while a < len(keys) and keys[a] in g1:
            a += 1
        b = a
        while b < len(keys) and keys[b] in prio:
            b += 1
        # vLLM offloads per request: after a G2 load only what follows the
        # G1 hits is offered to G2; with none, every block.
        for k in reversed(keys[a:] if b > a else keys):
            self._put(k, prio.get(k, 0))
        self._evict(set(keys))
        for k in reversed(keys):           # G1: the head ends most recent (vLLM frees tail first)
            if k in g1:
                g1.move_to_end(k)
            else:
                g1[k] = None
        while len(g1) > self.g1_capacity:
            g1.popitem(last=False)
        return b / self.rate

    def set(self, keys: Iterable[bytes], priority: int) -> None:
        """Give resident ``keys`` (sampled ones) a new priority, keeping their
        recency order."""
        for k in keys:
            p = self._prio.get(k)
            if p is not None and p != priority:
                self._drop(k, p)
                self._put(k, priority)

    def _put(self, k: bytes, p: int) -> None:
        old = self._prio.get(k)
        if old is not None and old != p:
            self._drop(k, old)
        bucket = self._buckets.get(p)
        if bucket is None:
            bucket = self._buckets[p] = OrderedDict()
            bisect.insort(self._levels, p)
        if k in bucket:
            bucket.move_to_end(k)
        else:
            bucket[k] = None
        self._prio[k] = p

    def _drop(self, k: bytes, p: int) -> None:
        bucket = self._buckets[p]
        del bucket[k]
        del self._prio[k]
        if not bucket:
            del self._buckets[p]
            self._levels.pop(bisect.bisect_left(self._levels, p))

    def _evict(self, protect: set[bytes]) -> None:
        """Down to capacity, never evicting ``protect`` (the request's own
        blocks: a G2 store makes room among the blocks already there)."""
        while len(self._prio) > self.capacity:
            for p in self._levels:
                victim = next((k for k in self._buckets[p] if k not in protect), None)
                if victim is not None:
                    break
            else:
                return          # only the request's own blocks left: it is larger than G2
            self._drop(victim, p)


class Selector:
    """Scores per strategy (exponentially decayed hits, half-life
    ``half_life_refs`` block references) and the one to follow: the best,
    kept until another beats it by ``margin``."""

    def __init__(self, names: Sequence[str], half_life_refs: float, margin: float = 0.02):
        if not names:
            raise ValueError("a selector needs at least one strategy")
        self.names = list(names)
        self.scores = dict.fromkeys(self.names, 0.0)
        self.current = self.names[0]
        self.switches = 0
        self._decay_per_ref = math.log(2.0) / max(1.0, half_life_refs)
        self._margin = margin

    def record(self, refs: int, hits: dict[str, float]) -> bool:
        """One request of ``refs`` block references and each strategy's hits
        on it; True when the strategy to follow changed."""
        d = math.exp(-self._decay_per_ref * refs)
        for name in self.names:
            self.scores[name] = self.scores[name] * d + hits.get(name, 0.0)
        best = max(self.names, key=self.scores.__getitem__)
        if best != self.current and \
                self.scores[best] > self.scores[self.current] * (1.0 + self._margin):
            self.current = best
            self.switches += 1
            return True
        return False
