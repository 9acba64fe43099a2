"""What a G3 tier reports to vLLM's KV events: the chunks it stored and the
stored ones it learned are gone (``OffloadingEvent``, medium STORAGE, which
vLLM's events tracker turns into ``BlockStored`` / ``BlockRemoved``: what
llm-d's indexer and Dynamo's router consume).

A chunk is *announced* (one stored event) when a store of this tier ends
with its object there: vLLM's cascades and hint copies (Demote, Share) alike.
It is announced once while announced, so each ``BlockStored`` is followed by
at most one ``BlockRemoved`` (a consumer that counts references balances);
the stored events ask vLLM's tracker to keep the chunk's payload until the
removal (``removal_expected``), so the removal names the same block hashes.
An announced chunk is reported removed when the tier learns it is gone:

- a lookup (vLLM's, or a hint copy's check) finds it missing, which is how
  evictions by the backend itself (Mooncake, Redis under ``maxmemory``) or
  by other engines are seen;
- a load of it failed with the backend up (missing, or unreadable / failing
  its seal: the tier unlists it);
- its TTL lapsed (``lapse_s``: Redis' ``ttl_s``; our own Pin pushes it back
  by the pin's TTL): reported at the end of the TTL of our store, which can
  be later than the server's by the store call's duration, and later by up
  to a TTL for an object another engine wrote first (our store then only
  found it);
- the tier's own eviction (``gone`` from DiskTier's evictor);
- the bound: at most ``cap`` chunks are announced; past it the one
  stored least recently is reported removed (the engine no longer vouches
  for it: an indexer may then under-count G3, never over-count).

Never reported: a removal of a chunk not announced (most lookups miss
chunks no engine stored), and a chunk gone that nothing here looks up again
(another engine's eviction, Mooncake's or Redis' own) until the bound or its
TTL retires it; nor one evicted between its put and the end of the store
call (the evictor takes the least recently used first) until a lookup.

Threading: every method takes the instance's lock (I/O, lookup and evictor
threads report; the scheduler thread takes); ``gone`` only for the chunks
announced. Cost, here: about 2 us a chunk stored, 0.2-0.4 us a chunk looked
up missing, 4 us a ``take`` with nothing new. Memory: at most ``cap``
announced chunks (about 170 bytes each, the key aside), the lapse heap within
``2 * cap + HEAP_SLACK`` entries, at most ``MAX_BATCHES`` reports waiting
for ``take`` (vLLM takes them every step; past it the oldest go).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.base import OffloadKey

MAX_BATCHES = 65_536
HEAP_SLACK = 1024


class StorageEvents:
    """A G3 tier's announced chunks and its reports (module docstring)."""

    def __init__(
        self, cap: int, lapse_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ):
        if cap <= 0:
            raise ValueError(f"cap must be positive, got {cap!r}")
        if lapse_s is not None and lapse_s <= 0:
            raise ValueError(f"lapse_s must be positive, got {lapse_s!r}")
        self._cap = cap
        self._lapse = lapse_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> when its TTL lapses (inf: never), oldest announcement first
        self._announced: OrderedDict[OffloadKey, float] = OrderedDict()
        self._due: list[tuple[float, OffloadKey]] = []  # lapses; stale when moved
        self._out: deque[tuple[list[OffloadKey], bool]] = deque(maxlen=MAX_BATCHES)

    def __len__(self) -> int:
        return len(self._announced)

    def stored(self, keys: Iterable[OffloadKey]) -> None:
        """A store ended with these chunks' objects there: the ones not
        announced yet are (a stored report); past ``cap`` the oldest are
        reported removed."""
        new, retired = [], []
        with self._lock:
            until = math.inf if self._lapse is None else self._clock() + self._lapse
            announced = self._announced
            for k in keys:
                if k in announced:
                    announced.move_to_end(k)
                    continue
                announced[k] = until
                new.append(k)
                if self._lapse is not None:
                    heapq.heappush(self._due, (until, k))
            while len(announced) > self._cap:
                retired.append(announced.popitem(last=False)[0])
            self._report(new, False)
            self._report(retired, True)

    def gone(self, keys: Iterable[OffloadKey]) -> None:
        """These chunks' objects are not there: the announced ones are
        reported removed."""
        # Most are lookups' misses of chunks never stored: sifted before the
        # lock (a dict read under the GIL), so ``take`` does not wait on them.
        known = [k for k in keys if k in self._announced]
        if not known:
            return
        with self._lock:
            pop = self._announced.pop
            self._report([k for k in known if pop(k, None) is not None], True)

    def held(self, keys: Iterable[OffloadKey], ttl_s: float) -> None:
        """Our Pin keeps these chunks for ``ttl_s`` (their TTL starts again
        after it): announced ones lapse no earlier than that."""
        if self._lapse is None:
            return
        with self._lock:
            until = self._clock() + ttl_s + self._lapse
            for k in keys:
                if self._announced.get(k, math.inf) < until:
                    self._announced[k] = until
                    heapq.heappush(self._due, (until, k))
            self._compact()

    def keys(self) -> list[OffloadKey]:
        """The announced chunks, now (a copy)."""
        with self._lock:
            return list(self._announced)

    def take(self) -> list[tuple[list[OffloadKey], bool]]:
        """The reports since the last call, in order, as ``(keys, removed)``;
        the chunks whose TTL lapsed since are reported removed last."""
        with self._lock:
            if self._lapse is not None:
                now, due, announced, lapsed = self._clock(), self._due, self._announced, []
                while due and due[0][0] <= now:
                    until, k = heapq.heappop(due)
                    if announced.get(k) == until:
                        del announced[k]
                        lapsed.append(k)
                self._report(lapsed, True)
            out = list(self._out)
            self._out.clear()
            return out

    def _report(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys:
            self._out.append((keys, removed))
        self._compact()

    def _compact(self) -> None:
        if len(self._due) > 2 * len(self._announced) + HEAP_SLACK:
            # Entries of chunks no longer announced, or pushed back: rebuilt
            # (O(cap), once per more than ``cap`` such entries).
            self._due = [(u, k) for k, u in self._announced.items() if u != math.inf]
            heapq.heapify(self._due)
