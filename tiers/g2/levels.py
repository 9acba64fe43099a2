"""EvictionLevels: the order in which ``SessionCachePolicy`` evicts, kept in levels.

The policy (``tiers/g2/policy.py``) says which level and order each chunk
has (plain, retained, pinned; its rank); this half of it files the
evictable chunks and finds each level's least. Its methods are the
policy's own, in a base class of their own; their state is the policy's,
set by ``SessionCachePolicy.__init__`` (listed below).

Data structure: the policy owns its ordering (it subclasses vLLM's abstract
``CachePolicy`` only, none of LRU's private fields). Every evictable chunk
(ref_cnt 0) sits in one *level*: 0 for plain, the priority for retained, and
``PIN_LEVEL`` above all for pinned; each level is a lazy min-heap of
(order, key), order the rank (for pins: (when pinned, rank)). A chunk's
valid entry is recorded in ``_at``; moving it (a hint, a touch, a lapse)
pushes a new entry and the old one is dropped when popped. Level 0 also
keeps two orderings that chunks filed in rank order join in O(1), with no
entry left to go stale when they leave:

- the run (``_run``, an ``OrderedDict``) takes every chunk with a rank of
  its own (position 0: every chunk on 0.32) filed with a rank above all
  before it: every use of an evictable chunk (its new rank is the highest),
  and stores that end in the order they began. Uses never grow a heap,
  whose rebuild from all its entries was a 394 ms stall at 262,144 chunks
  (tests/tiers/test_g2_policies.py);
- a group per request rank (``_groups``, each an ``OrderedDict`` in rank
  order, found through a lazy heap of request ranks, ``_group_heap``) takes
  a 0.33 request's chunks filed below its least one or above its greatest:
  a request stores its chunks head to tail, each the new least of its
  group, and accesses its reused prefix head to tail the same way.

Chunks filed out of order (loads, demotes, a use's older ranks, a chunk
landing inside its group) go to the heap; the level's least is the least
of the run's front, the first group's front and the heap's top.

Chunks that become evictable (a store or load ends) wait in ``_arriving``
and are filed by the next ``insert`` or ``evict`` (or once ``ARRIVING_MAX``
wait), by rank and, within a request's rank, head first (each the new least
of its group); a hint or use that changes one meanwhile is seen when it is
filed. vLLM ends a step's stores in the order its worker reports their
jobs, not the order they began: filed as they ended, 981 of 1,009
evictions in bench/scale.py's 4k decode steps (0.32) came from the heap,
each pop O(log n) with a cache miss per level at 262,144 chunks; filed
sorted, 1,009 of 1,009 came from the run, O(1) each. Which chunks are
evictable at an ``evict`` is the same either way, so the choices are the
same.

Cost: filing a chunk is O(1) into the run or a group, else O(log n); a
level's least is O(1) plus the stale heap tops it drops; heaps are compacted
when they hold twice their live entries.

Threading: as the policy's: not thread-safe on its own.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

PIN_LEVEL = 1 << 62  # above every retain priority: pins go last
# Chunks made evictable wait to be filed until the next store begins or
# evicts (``insert``, ``evict``): a step's completions, which one sort puts in
# order. At most this many wait, so that a stretch of loads with no store
# cannot leave one filing of up to all of G2 (262,144 at 1 us each) to a step.
ARRIVING_MAX = 4096
# vLLM 0.33 ranks by request and position and reports accesses
# (``tiers/g2/policy.py``); 0.32's CachePolicy has no such hook. A public
# name, read by feature: a later release of the same shape needs nothing here.
BY_POSITION: bool = hasattr(CachePolicy, "on_request_access")
SHIFT = 48 if BY_POSITION else 0  # positions (tokens) below 2**48
LOW = (1 << SHIFT) - 1
# where a level-0 least was found (``_least``)
_HEAP, _RUN, _GROUP = 0, 1, 2
# A level's order: the rank (an int) below PIN_LEVEL, (pinned_at, rank) at it.
# Orders are compared within one level only, so each level has one type, which
# a type checker cannot tell from the level: Any.
_Order = Any


class EvictionLevels(CachePolicy):
    """Evictable chunks in levels, each with its least (see the module docstring)."""

    # The policy's state that the levels read and write (``SessionCachePolicy.__init__``).
    _rank: dict[OffloadKey, int]
    _pins: dict[OffloadKey, tuple[float, float]]
    _retains: dict[OffloadKey, tuple[int, float, str | None]]
    _at: dict[OffloadKey, tuple[int, _Order]]
    _heaps: dict[int, list[tuple[_Order, OffloadKey]]]
    _size: dict[int, int]
    _levels: list[int]
    _run: OrderedDict[OffloadKey, int]
    _run_top: int
    _groups: dict[int, OrderedDict[OffloadKey, int]]
    _group_heap: list[int]
    _arriving: dict[OffloadKey, None]
    _filing_key: Callable[[OffloadKey], int]

    def _place(self, k: OffloadKey) -> tuple[int, _Order]:
        if not self._pins and not self._retains:  # no hints: every chunk is plain
            return 0, self._rank[k]
        pin = self._pins.get(k)
        if pin is not None:
            return PIN_LEVEL, (pin[0], self._rank[k])
        ret = self._retains.get(k)
        return (ret[0] if ret is not None and ret[0] > 0 else 0), self._rank[k]

    def _file(self, k: OffloadKey) -> None:
        """(Re)file evictable ``k`` at its current level and order."""
        where = self._place(k)
        old = self._at.get(k)
        if old == where:
            return
        if old is not None:
            self._leave(k, old)
        self._at[k] = where
        level, order = where
        if level not in self._size:
            self._size[level] = 0
            self._heaps[level] = []
            bisect.insort(self._levels, level)
        self._size[level] += 1
        if level == 0 and order > self._run_top and order & LOW == LOW:  # a rank of its own
            self._run[k] = self._run_top = order
            return
        if level == 0 and order & LOW != LOW and self._join_group(k, order):
            return
        heap = self._heaps[level]
        heapq.heappush(heap, (order, k))
        if len(heap) > 2 * self._size[level] + 64:  # drop entries that went stale
            heap[:] = [(o, q) for o, q in heap if self._at.get(q) == (level, o)]
            heapq.heapify(heap)

    def _join_group(self, k: OffloadKey, order: int) -> bool:
        """File level-0 ``k`` of a request's rank in that request's group,
        when it is below the group's least or above its greatest (in (order,
        key) order, as vLLM's heap compares); whether it joined."""
        r = order >> SHIFT
        group = self._groups.get(r)
        if group is None:
            self._groups[r] = OrderedDict(((k, order),))
            heapq.heappush(self._group_heap, r)
            if len(self._group_heap) > 2 * len(self._groups) + 64:
                self._group_heap = list(self._groups)
                heapq.heapify(self._group_heap)
            return True
        first = next(iter(group))
        o = group[first]
        if order < o or (order == o and k < first):
            group[k] = order
            group.move_to_end(k, last=False)
            return True
        last = next(reversed(group))
        o = group[last]
        if order > o or (order == o and k > last):
            group[k] = order
            return True
        return False

    def _arrive(self, k: OffloadKey) -> None:
        """``k`` became evictable: filed by the next ``_settle``."""
        self._arriving[k] = None
        if len(self._arriving) >= ARRIVING_MAX:
            self._settle()

    def _settle(self) -> None:
        """File the arrived keys in filing order (module docstring)."""
        arriving, self._arriving = self._arriving, {}
        for k in sorted(arriving, key=self._filing_key) if len(arriving) > 1 else arriving:
            self._file(k)

    def _unfile(self, k: OffloadKey) -> None:
        if self._arriving:
            self._arriving.pop(k, None)
        old = self._at.pop(k, None)
        if old is not None:
            self._leave(k, old)

    def _leave(self, k: OffloadKey, where: tuple[int, _Order]) -> None:
        """``k`` leaves its ``where`` (its heap entry goes stale, its run or
        group entry goes)."""
        level = where[0]
        if level == 0 and self._run.pop(k, None) is None and self._groups:
            self._ungroup(k, where[1] >> SHIFT)
        self._shrink(level)

    def _ungroup(self, k: OffloadKey, r: int) -> None:
        group = self._groups.get(r)
        if group is not None and group.pop(k, None) is not None and not group:
            del self._groups[r]

    def _least(self, level: int) -> tuple[_Order, OffloadKey, int] | None:
        """The least valid entry of ``level`` in (order, key) order and where
        it is (``_HEAP``, ``_RUN``, ``_GROUP``), stale heap tops dropped on
        the way; None when empty."""
        heap, at = self._heaps[level], self._at
        while heap and at.get(heap[0][1]) != (level, heap[0][0]):
            heapq.heappop(heap)
        if level == 0 and self._run and not self._groups:
            k = next(iter(self._run))
            o = self._run[k]
            if not heap or o < heap[0][0] or (o == heap[0][0] and k < heap[0][1]):
                return o, k, _RUN
        elif level == 0 and self._groups:
            return self._least_plain(heap)
        return (heap[0][0], heap[0][1], _HEAP) if heap else None

    def _least_plain(
        self, heap: list[tuple[_Order, OffloadKey]]
    ) -> tuple[_Order, OffloadKey, int] | None:
        """``_least`` of level 0 when a group is in it: the least of the
        heap's top (valid), the run's front and the first group's front."""
        o: _Order = None
        k: OffloadKey | None = None
        where = _HEAP
        if heap:
            o, k = heap[0]
        run = self._run
        if run:
            rk = next(iter(run))
            ro = run[rk]
            if k is None or ro < o or (ro == o and rk < k):
                o, k, where = ro, rk, _RUN
        gheap, groups = self._group_heap, self._groups
        while gheap[0] not in groups:
            heapq.heappop(gheap)
        group = groups[gheap[0]]
        gk = next(iter(group))
        go = group[gk]
        if k is None or go < o or (go == o and gk < k):
            o, k, where = go, gk, _GROUP
        return o, k, where

    def _shrink(self, level: int) -> None:
        self._size[level] -= 1
        if not self._size[level]:
            del self._size[level], self._heaps[level]
            self._levels.pop(bisect.bisect_left(self._levels, level))

    def _refile(self, k: OffloadKey) -> None:
        """After ``k``'s bias or rank changed: refile it when evictable."""
        if k in self._at:
            self._file(k)
