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

Recency is a rank per block, as in vLLM 0.33's LRU policy (the CUDA
release the engines run; ``tiers/g2/policy.py`` keeps it exactly): a turn
draws a rank when it starts (``request``), and the blocks it reads or stores
rank (that rank, -position): new ones enter there, resident ones rise to it,
never fall. So while a turn runs its blocks go after every block last used
before it began, tail first, and before those of turns that began or ended
after it. When it ends (``finish``) its blocks become the most recent, its
head last. A turn that ends before the next request (``request`` without a
``turn``) is served and ended at once. A Retain changes a block's priority,
not its rank. (vLLM 0.32, the CPU build, ranks a running request's stores by
when they were stored and leaves a reused prefix at its last rank until the
request ends, so that a store may evict the prefix its request just read.)

A rank is one int, ``rank << SHIFT | (LOW ^ position)`` (position 0 for the
ranks ``finish`` gives), so that heaps compare ints.

Cost: a request or a finish costs O((its sampled blocks + the blocks it
evicts) x log) per shadow: one heap of (rank, key) per priority, stale
entries dropped lazily.
Memory: at most ``max_blocks`` keys per shadow, and as many references to
the sampled blocks of the turns running (beyond, the oldest turn is
forgotten: its blocks keep their turn's rank, as in an engine where it never
ended). Not thread-safe: the policy that owns the shadows calls them
from one thread (the router's event loop).
"""

from __future__ import annotations

import bisect
import builtins
import heapq
import math
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

_SPACE = 1 << 32
SHIFT = 32  # a block's position in its request fits below
LOW = (1 << SHIFT) - 1


def sampled(key: bytes, rate: float) -> bool:
    """Whether ``key`` is in a shadow sampled at ``rate`` (by a CRC of the
    key: keys need not be uniform bytes, the replay's are small ids)."""
    return rate >= 1.0 or zlib.crc32(key) < rate * _SPACE


class ShadowCache:
    """One strategy's model of one engine's G2 (see the module docstring)."""

    def __init__(
        self,
        capacity_blocks: int,
        g1_blocks: int = 0,
        max_blocks: int = 65_536,
        exempt_owner: str | None = None,
    ):
        """``exempt_owner``: whose Retained blocks ``retained_evictions`` does
        not count (the router's own watches, meant to go first)."""
        if capacity_blocks < 1 or g1_blocks < 0:
            raise ValueError("a shadow cache needs a G2 of at least one block and a G1 >= 0")
        self.rate = min(1.0, max_blocks / (capacity_blocks + g1_blocks))
        self.capacity = max(1, int(capacity_blocks * self.rate))
        self.g1_capacity = int(g1_blocks * self.rate)
        self._g1: OrderedDict[bytes, None] = OrderedDict()
        self._prio: dict[bytes, int] = {}  # resident key -> its priority
        self._rank: dict[bytes, int] = {}  # resident key -> when last used (higher: later)
        self._owner: dict[bytes, str] = {}  # retained key -> who retained it last
        self._next = 0
        # per priority: a min-heap of (rank, key), stale entries dropped lazily
        self._heaps: dict[int, list[tuple[int, bytes]]] = {}
        self._size: dict[int, int] = {}  # per priority: resident keys
        self._levels: list[int] = []  # sorted priorities with a resident key
        # turns running: turn -> the sampled blocks it read or stored, and
        # how many those are, over all turns
        self._open: OrderedDict[str, Sequence[bytes]] = OrderedDict()
        self._open_blocks = 0
        self._open_max = max_blocks
        self.retained_evictions = 0  # evicted blocks Retained above 0 by a session
        self._exempt = exempt_owner

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is resident in the shadow's G2."""
        return key in self._prio

    def keys_of(self, keys: Iterable[bytes]) -> list[bytes]:
        """The sampled ones of ``keys``, in order."""
        rate = self.rate
        return list(keys) if rate >= 1.0 else [k for k in keys if sampled(k, rate)]

    def request(
        self, keys: Sequence[bytes], counted: int | None = None, turn: str | None = None
    ) -> float:
        """Serve a request's sampled ``keys``: its leading resident run among
        the first ``counted`` (default all; scaled to all keys), then every
        key it reads or stores resident at its turn's rank and position (at
        its priority; new ones plain), room made among the other blocks.
        ``turn`` names it until ``finish`` (an earlier turn of that name
        ends first); without one it ends at once."""
        if turn is not None:
            self.finish(turn)
        g1, prio = self._g1, self._prio
        n = len(keys) if counted is None else min(counted, len(keys))
        a = 0  # G1's leading run, then G2's
        while a < n and keys[a] in g1:
            a += 1
        b = a
        while b < n and keys[b] in prio:
            b += 1
        # vLLM offloads per request: after a G2 load only what follows the
        # G1 hits is read or offered to G2; with none, every block.
        used = keys[a:] if b > a else list(keys)
        self._next += 1
        base = self._next << SHIFT | LOW
        for position, k in enumerate(used, len(keys) - len(used) + 1):
            self._access(k, base ^ position)
        self._evict(set(keys))
        if turn is None:
            self._use(used)
        else:
            self._open[turn] = used
            self._open_blocks += len(used)
            while self._open_blocks > self._open_max and len(self._open) > 1:
                self._open_blocks -= len(self._open.popitem(last=False)[1])
        for k in reversed(keys):  # G1: the head ends most recent (vLLM frees tail first)
            if k in g1:
                g1.move_to_end(k)
            else:
                g1[k] = None
        while len(g1) > self.g1_capacity:
            g1.popitem(last=False)
        return b / self.rate

    def finish(self, turn: str) -> None:
        """``turn`` ended: the blocks it read or stored that are still
        resident become the most recent, its head last (vLLM's
        ``on_request_finished``). Nothing for a turn not running."""
        used = self._open.pop(turn, None)
        if used is not None:
            self._open_blocks -= len(used)
            self._use(used)

    def _use(self, keys: Sequence[bytes]) -> None:
        prio = self._prio
        for k in reversed(keys):
            p = prio.get(k)
            if p is not None:
                self._next += 1
                self._push(k, p, self._next << SHIFT | LOW)

    def set(self, keys: Iterable[bytes], priority: int, owner: str) -> None:
        """A Retain of resident ``keys`` (sampled ones) by ``owner``: their
        new priority and owner (the last Retain of a key replaces the one
        before), their recency kept (a Retain does not make a chunk recent)."""
        prio, owners = self._prio, self._owner
        for k in keys:
            p = prio.get(k)
            if p is None:
                continue
            owners[k] = owner
            if p != priority:
                self._reprioritize(k, p, priority)

    def release(self, keys: Iterable[bytes], owner: str) -> None:
        """``owner``'s Retains of ``keys`` end (its session ended, or its TTL
        lapsed): those it still owns are plain again."""
        owners = self._owner
        for k in keys:
            if owners.get(k) == owner:
                del owners[k]
                p = self._prio[k]
                if p:
                    self._reprioritize(k, p, 0)

    def _reprioritize(self, k: bytes, old: int, p: int) -> None:
        """Resident ``k`` from level ``old`` to ``p``, its rank kept."""
        self._move(k, old, p)
        heapq.heappush(self._heap_of(p), (self._rank[k], k))

    def _heap_of(self, p: int) -> list[tuple[int, bytes]]:
        heap = self._heaps.get(p)
        if heap is None:
            heap = self._heaps[p] = []
        return heap

    def _move(self, k: bytes, old: int | None, p: int | None) -> None:
        """Count ``k`` at level ``p`` instead of ``old`` (None: not resident)."""
        size = self._size
        if old is not None:
            size[old] -= 1
            if not size[old]:
                del size[old]
                self._levels.pop(bisect.bisect_left(self._levels, old))
                del self._heaps[old]
        if p is None:
            del self._prio[k]
            del self._rank[k]
            self._owner.pop(k, None)
            return
        if p not in size:
            size[p] = 0
            bisect.insort(self._levels, p)
        size[p] += 1
        self._prio[k] = p

    def _access(self, k: bytes, rank: int) -> None:
        """``k`` resident (new ones plain) at ``rank`` or above."""
        p = self._prio.get(k)
        if p is None:
            p = 0
            self._move(k, None, 0)
        elif self._rank[k] >= rank:
            return
        self._push(k, p, rank)

    def _push(self, k: bytes, p: int, rank: int) -> None:
        """Resident ``k`` at level ``p`` takes ``rank``."""
        self._rank[k] = rank
        heap = self._heap_of(p)
        heapq.heappush(heap, (rank, k))
        if len(heap) > 2 * self._size[p] + 64:  # drop entries that went stale
            heap[:] = [(r, q) for r, q in heap if self._prio.get(q) == p and self._rank[q] == r]
            heapq.heapify(heap)

    def _victim(self, protect: builtins.set[bytes]) -> bytes | None:
        """The least recent block of the lowest level, not in ``protect``."""
        prio, rank = self._prio, self._rank
        for p in self._levels:
            heap, deferred, found = self._heaps[p], [], None
            while heap:
                r, k = heapq.heappop(heap)
                if prio.get(k) != p or rank[k] != r:
                    continue  # stale: moved or used since
                if k in protect:
                    deferred.append((r, k))
                    continue
                found = k
                break
            for e in deferred:
                heapq.heappush(heap, e)
            if found is not None:
                return found
        return None

    def _evict(self, protect: builtins.set[bytes]) -> None:
        """Down to capacity, never evicting ``protect`` (the request's own
        blocks: a G2 store makes room among the blocks already there)."""
        while len(self._prio) > self.capacity:
            victim = self._victim(protect)
            if victim is None:
                return  # only the request's own blocks left: it is larger than G2
            if self._prio[victim] > 0 and self._owner.get(victim) != self._exempt:
                self.retained_evictions += 1
            self._move(victim, self._prio[victim], None)


class Selector:
    """Scores per strategy (exponentially decayed hits, half-life
    ``half_life_refs`` block references) and the one to follow: the best,
    kept until another beats it by ``margin``, or leads it by a consistent
    margin too small for that: by ``z`` standard errors of their per-request
    differences (decayed the same way).

    Why both: the ratio alone kept a strategy that trailed by 1 % for the
    last 80 % of the conversation trace at 4096 blocks (0.989 of the best
    fixed strategy's shadow hits, the engine 0.749 x opt against 0.761 for
    that strategy); a smaller ratio flip-flopped on noisy traffic (Mooncake's
    synthetic trace: 9 switches, 0.997 -> 0.984 x the best simple policy). A
    lead of ``z`` standard errors is one noise does not make, at any size.
    Cost: O(strategies^2) per request (ten pairs for five)."""

    def __init__(
        self, names: Sequence[str], half_life_refs: float, margin: float = 0.02, z: float = 2.0
    ):
        if not names:
            raise ValueError("a selector needs at least one strategy")
        self.names = list(names)
        self.scores = dict.fromkeys(self.names, 0.0)
        self.current = self.names[0]
        self.switches = 0
        self._decay_per_ref = math.log(2.0) / max(1.0, half_life_refs)
        self._margin = margin
        self._z = z
        # per pair (a, b), a before b in names: decayed sums of hits[a] - hits[b]
        # and of its square (weights squared: the variance of the decayed sum)
        self._pairs = [(a, b) for i, a in enumerate(self.names) for b in self.names[i + 1 :]]
        self._diff = dict.fromkeys(self._pairs, 0.0)
        self._var = dict.fromkeys(self._pairs, 0.0)

    def record(self, refs: int, hits: dict[str, float]) -> bool:
        """One request of ``refs`` block references and each strategy's hits
        on it; True when the strategy to follow changed."""
        d = math.exp(-self._decay_per_ref * refs)
        for name in self.names:
            self.scores[name] = self.scores[name] * d + hits.get(name, 0.0)
        d2, diff, var = d * d, self._diff, self._var
        for a, b in self._pairs:
            x = hits.get(a, 0.0) - hits.get(b, 0.0)
            diff[a, b] = diff[a, b] * d + x
            var[a, b] = var[a, b] * d2 + x * x
        best = max(self.names, key=self.scores.__getitem__)
        if best != self.current and (
            self.scores[best] > self.scores[self.current] * (1.0 + self._margin)
            or self._lead(best, self.current) > self._z
        ):
            self.current = best
            self.switches += 1
            return True
        return False

    def _lead(self, a: str, b: str) -> float:
        """``a``'s lead over ``b`` in standard errors (0 with no evidence)."""
        if (a, b) in self._diff:
            lead, var = self._diff[a, b], self._var[a, b]
        else:
            lead, var = -self._diff[b, a], self._var[b, a]
        return lead / math.sqrt(var) if var > 0.0 else 0.0
