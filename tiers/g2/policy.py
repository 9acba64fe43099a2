"""SessionCachePolicy: G2's eviction order, vLLM's LRU biased by Pin and Retain.

Eviction order, for ``evict(n, protected)``:

1. chunks neither pinned nor retained (or retained at priority 0): plain LRU,
   so un-hinted traffic evicts exactly as the running vLLM's
   ``LRUCachePolicy`` (below); demoted chunks (``demote``: a Demote hint
   copied them to G3) before all others;
2. retained chunks, lowest priority first, least recently used first within a
   priority;
3. pinned chunks only when nothing else is left: the oldest pins first (least
   recently used among equals), clipped (``take_clipped()`` hands them to the
   hint executor for its outcomes), so pins never stall a store.

The evicted chunks come back least recent first, as LRU returns them.

Recency ("least recently used") is a rank per chunk, the running release's:

- vLLM 0.32: a store (``insert``) gives the chunk the next rank; ``touch``
  and ``on_request_finished`` give each present key the next rank, the
  request's head last. The least rank goes first.
- vLLM 0.33 (found by feature: its ``CachePolicy`` has
  ``on_request_access``; ``BY_POSITION``): the rank is the pair (request
  rank, -position). A request draws its rank from the same counter at its
  first ``on_request_access`` or its first store of a key with a position
  (once per request and per cache generation: ``clear`` starts a new one).
  A store of a key with an offload key position in the request's context
  gets (that rank, -position), and ``on_request_access`` (vLLM's manager
  reports each key a request loads or offers, once) lifts a present key to
  it, never lowers one. So a running request's chunks, its reused prefix
  included, go after every chunk last used before it began, tail first (its
  head last: the head is what makes the rest reachable). A store without a
  position, ``touch`` and ``on_request_finished`` give (next rank, 0), as
  on 0.32. Equal pairs (two KV cache groups' keys at one position) go in key
  order, as vLLM's heap breaks them.

A rank is one int, ``rank << SHIFT | (LOW ^ position)`` (position 0 for a
rank of its own), so that both releases compare plain ints; on 0.32 SHIFT is
0 and a rank is the counter itself.

Pins and retains carry an expiry; lapsed ones are dropped lazily. Every pin
that ends other than by ``unpin`` or a clip (it lapsed, its chunk was removed
or demoted, a reset) is handed out once by ``take_unpinned()``, so the hint
executor keeps its pin book without a pass over all pins; it drains the set
every step, which bounds it.

Data structure: the policy is an ``EvictionLevels`` (``tiers/g2/levels.py``):
every evictable chunk sits in one level (0 for plain, the priority for
retained, ``PIN_LEVEL`` above all for pinned), ordered so that filing a
chunk and finding a level's least cost what is written below.

Cost: ``evict(n)`` pops O(n + stale + protected) entries from the lowest
levels, with no sort and no pass over the chunks, however many are pinned or
retained; a hint or touch costs O(log n) per chunk (O(1) into the run or a
group); a request's first filed chunk O(log requests); heaps are compacted
when they hold twice their live entries. Memory: O(chunks + live hints).

vLLM builds policies as ``cls(cache_capacity=n)`` (``eviction_policy`` +
``cache_policy_module_path``); the limits live in the hint executor, which
calls ``pin``/``retain`` here.

Threading: called by vLLM's CPU manager on the scheduler thread, and by hint
code holding the tier manager's lock; not thread-safe on its own.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys

from sessionkv.tiers.g2.levels import (
    _HEAP,
    _RUN,
    BY_POSITION,
    LOW,
    SHIFT,
    EvictionLevels,
    _Order,
)

_INF = float("inf")


@dataclass(slots=True)
class _RequestRank:
    """A request's rank in one policy, kept in its ``ReqContext`` (which
    keys state by type: vLLM's LRU keeps its own beside it)."""

    owner: object
    generation: int
    rank: int


class SessionCachePolicy(EvictionLevels):
    """LRU with pins (protected until their TTL) and retains (ordered by priority)."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._rank: dict[OffloadKey, int] = {}  # recency: higher is later
        self._next_rank = 0
        self._generation = 0  # of the cache: ``clear`` starts a new one
        self._demoted = 0  # ranks of demoted chunks count down from here
        self._demoted_keys: set[OffloadKey] = set()
        self._pins: dict[OffloadKey, tuple[float, float]] = {}  # key -> (pinned_at, expiry)
        # key -> (priority, expiry, owner)
        self._retains: dict[OffloadKey, tuple[int, float, str | None]] = {}
        self._owned: dict[str, set[OffloadKey]] = {}  # owner -> the keys it retains
        self._clipped: list[OffloadKey] = []
        self._unpinned: set[OffloadKey] = set()  # see take_unpinned
        # evictable key -> (level, order) of its one valid heap entry
        self._at: dict[OffloadKey, tuple[int, _Order]] = {}
        self._heaps: dict[int, list[tuple[_Order, OffloadKey]]] = {}
        self._size: dict[int, int] = {}  # level -> evictable keys in it
        self._levels: list[int] = []  # sorted levels with a key
        # level-0 keys with a rank of their own filed in rank order, key ->
        # rank (``tiers/g2/levels.py``); the highest rank it took, which the next
        # must pass to join it
        self._run: OrderedDict[OffloadKey, int] = OrderedDict()
        self._run_top = 0
        # level-0 keys of a request's rank (0.33), per request rank, in rank
        # order; a lazy min-heap of the request ranks (one valid entry or more
        # per group, stale ones dropped when on top or by compaction)
        self._groups: dict[int, OrderedDict[OffloadKey, int]] = {}
        self._group_heap: list[int] = []
        # keys made evictable, not filed yet (``_settle``: ``tiers/g2/levels.py``)
        self._arriving: dict[OffloadKey, None] = {}
        rank = self._rank
        # the filing order of arrived keys: by rank, and head first (position
        # up) within a request's rank, so each joins its group at the front
        self._filing_key: Callable[[OffloadKey], int] = (
            (lambda k: rank[k] ^ LOW) if LOW else rank.__getitem__
        )
        # (expiry, key) of every pin and retain set, lazily invalidated: lapses
        # are found without a pass over all hints on every eviction.
        self._expiries: list[tuple[float, OffloadKey]] = []

    # ------------------------------------------------------------- the ranks

    def _new_rank(self, k: OffloadKey) -> None:
        self._next_rank += 1
        self._rank[k] = self._next_rank << SHIFT | LOW
        self._refile(k)

    def _request_rank(self, req_context: ReqContext) -> int:
        """The rank of ``req_context``'s request, drawn on its first call in
        this cache generation (vLLM 0.33's ``LRUCachePolicy`` alike)."""
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestRank(self, self._generation, self._next_rank)
            req_context.set_state(state)
        return state.rank

    # ------------------------------------------------------------------ hints

    def _track(self, expiry: float, k: OffloadKey) -> None:
        if expiry != _INF:
            heapq.heappush(self._expiries, (expiry, k))

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
                self._refile(k)
                n += 1
        return n

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            if self._pins.pop(k, None) is not None:
                self._refile(k)

    def retain(
        self,
        keys: Iterable[OffloadKey],
        priority: int,
        ttl_s: float | None,
        owner: str | None = None,
    ) -> int:
        """Order present chunks after lower priorities (until now + ttl_s), on
        behalf of ``owner`` (a session); how many."""
        expiry = _INF if ttl_s is None else self.clock() + ttl_s
        n = 0
        for k in keys:
            if k in self.chunks:
                self._drop_retain(k)
                self._retains[k] = (priority, expiry, owner)
                if owner is not None:
                    self._owned.setdefault(owner, set()).add(k)
                self._track(expiry, k)
                self._refile(k)
                n += 1
        return n

    def release_retains(self, owner: str) -> int:
        """Drop the retains ``owner`` set last (its session ended); how many."""
        mine = self._owned.pop(owner, set())
        for k in mine:
            del self._retains[k]
            self._refile(k)
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

    def demote(self, keys: Iterable[OffloadKey], owner: str | None = None) -> int:
        """Make these chunks the first to go (a Demote hint: their G3 copy
        exists), the last of ``keys`` first; their pins and retains end. They
        stay first until a request uses them again (vLLM finishing the
        request that stored them is no use). With ``owner`` (the Demote's
        session), a chunk that a pin holds or another owner retains keeps its
        place: one session's Demote never demotes what others hold (a shared
        document). How many were demoted."""
        n = 0
        for k in keys:
            if k not in self.chunks:
                continue
            if owner is not None and (
                k in self._pins or self._retains.get(k, (0, 0.0, owner))[2] != owner
            ):
                continue
            self._demoted_keys.add(k)
            self._lose_pin(k)
            self._drop_retain(k)
            self._demoted -= 1  # below every rank a use assigns
            self._rank[k] = self._demoted << SHIFT | LOW
            self._refile(k)
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
                self._refile(k)
        if len(heap) > 2 * (len(self._pins) + len(self._retains)) + 64:
            self._expiries = [(e, k) for k, (_, e) in self._pins.items()]
            self._expiries += [(e, k) for k, (_, e, _) in self._retains.items() if e != _INF]
            heapq.heapify(self._expiries)

    # ------------------------------------------------------- vLLM's contract

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None
    ) -> None:
        # vLLM 0.33 passes the storing request's context (tiers/compat.py),
        # 0.32 none.
        if self._arriving:
            self._settle()
        self.chunks[key] = chunk
        if (
            BY_POSITION
            and req_context is not None
            and (position := req_context.get_offload_key_position(key)) is not None
        ):
            self._rank[key] = self._request_rank(req_context) << SHIFT | LOW ^ min(position, LOW)
        else:
            self._next_rank += 1
            self._rank[key] = self._next_rank << SHIFT | LOW
        if chunk.ref_cnt == 0:
            self._arrive(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        if self._demoted_keys:
            self._demoted_keys.difference_update(keys)
        self._use(reversed(keys))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """vLLM 0.33: a request's first access of ``keys`` (a load, or a store
        offer of chunks present or not): each present key with a position
        rises to (the request's rank, -position), never lower; a use, so a
        demoted chunk is no longer first. Nothing on 0.32, whose LRU has no
        such hook (vLLM 0.32 never calls it). O(keys), O(log n) each moved."""
        if not BY_POSITION:
            return
        base = self._request_rank(req_context) << SHIFT | LOW
        chunks, rank, demoted = self.chunks, self._rank, self._demoted_keys
        for k in keys:
            position = req_context.get_offload_key_position(k)
            if position is None or k not in chunks:
                continue
            order = base ^ min(position, LOW)
            if rank[k] >= order:
                continue
            rank[k] = order
            if demoted:
                demoted.discard(k)
            self._refile(k)

    def _use(self, keys: Iterable[OffloadKey]) -> None:
        """Make present ``keys`` the most recent, the last of them last."""
        chunks = self.chunks
        for k in keys:
            if k in chunks:
                self._new_rank(k)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._use(reversed(order_request_keys(key_groups, req_context)))
        if self._demoted_keys:
            # The request that stored demoted chunks may finish after the
            # Demote (vLLM waits for its stores): it does not make them recent.
            self._demoted_keys.difference_update(reused_keys)
            self.demote([k for g in key_groups for k in g if k in self._demoted_keys])

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._rank.pop(key, None)
        self._unfile(key)
        self._demoted_keys.discard(key)
        self._lose_pin(key)
        self._drop_retain(key)

    def clear(self) -> None:
        self.chunks.clear()
        self._rank.clear()
        self._next_rank = 0
        self._generation += 1  # requests draw new ranks (vLLM 0.33 alike)
        self._at.clear()
        self._run.clear()
        self._run_top = 0
        self._groups.clear()
        self._group_heap.clear()
        self._arriving.clear()
        self._heaps.clear()
        self._size.clear()
        self._levels.clear()
        self._demoted_keys.clear()
        self._expiries.clear()
        self._unpinned.update(self._pins)
        self._pins.clear()
        self._retains.clear()
        self._owned.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._arrive(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._unfile(key)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        if self._arriving:
            self._settle()
        if self._expiries:
            self._expire()
        if n == 1 and self._levels:
            # A store's one chunk (16 a decode step at 256 x 64k): the lowest
            # level's least, as the general loop below would choose it.
            level = self._levels[0]
            least = self._least(level)
            if least is not None and least[1] not in protected:
                if least[2] == _HEAP:
                    heapq.heappop(self._heaps[level])
                return [self._evicted(least[1])]
        chosen: list[tuple[int, tuple[_Order, OffloadKey]]] = []
        skipped: list[tuple[int, tuple[_Order, OffloadKey]]] = []  # protected ones
        seen: set[OffloadKey] = set()
        for level in self._levels:
            while len(chosen) < n:
                least = self._least(level)
                if least is None:
                    break
                order, k, where = least
                # taken out; put back (if it is) as a heap entry, valid as well
                if where == _HEAP:
                    heapq.heappop(self._heaps[level])
                elif where == _RUN:
                    del self._run[k]
                else:
                    self._ungroup(k, order >> SHIFT)
                # a duplicate: a chunk that left a level and came back at the
                # same order has two entries
                if k in seen:
                    continue
                seen.add(k)
                (skipped if k in protected else chosen).append((level, (order, k)))
            if len(chosen) == n:
                break
        for level, entry in skipped if len(chosen) == n else skipped + chosen:
            heapq.heappush(self._heaps[level], entry)
        if len(chosen) < n:
            return None  # atomic: nothing changed
        rank = self._rank
        keys = sorted((entry[1] for _, entry in chosen), key=rank.__getitem__)
        return [self._evicted(k) for k in keys]

    def _evicted(self, k: OffloadKey) -> tuple[OffloadKey, ChunkStatus]:
        """Forget chosen ``k``; a pin it had is clipped."""
        out = (k, self.chunks.pop(k))
        del self._rank[k]
        self._unfile(k)
        if self._demoted_keys:
            self._demoted_keys.discard(k)
        if self._pins and self._pins.pop(k, None) is not None:
            self._clipped.append(k)
        if self._retains:
            self._drop_retain(k)
        return out
