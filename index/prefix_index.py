"""SessionPrefixIndex: which logical KV blocks each session holds, and where.

A node is one logical block: vLLM's ``OffloadKey`` bytes (BlockHash + KV cache
group). Nodes form the prefix tree that chained block hashes define (parent
link, depth, child count); shared ancestors are stored once. Each node counts
its copies per tier (G1, G2, G3). A session is a set of *frontier* nodes, one per
concurrent branch; its members are the resident nodes on the paths from the
root to its frontiers. One session has many branches, one block belongs to many
sessions, one key may have several copies.

Invariants, kept by every operation:

- a frontier is resident (has a copy in some tier). When its last copy goes,
  the frontier retreats to the nearest resident ancestor, or the branch is
  removed when there is none or when another branch of the session already
  covers that ancestor;
- no frontier is an ancestor of another frontier of the same session;
- every leaf is resident or a frontier: nodes with no copy and no resident
  descendant are pruned; parent-only nodes stay while they connect resident
  descendants;
- sessions are kept in order of last access, oldest first, and an access is
  dated no earlier than the newest before it (the callers' clocks are
  monotonic): idle expiry and ``recent_sessions`` cost what they return, not
  a pass over every session.

G1 copies have no eviction callback in vLLM, so G1 residency is refreshed
lazily: a query first asks ``g1_probe`` (the connector's view of vLLM's block
pool) for the G1 copy counts of the nodes it is about to report.

Threading: not thread-safe. One owner (the connector, on vLLM's scheduler
thread, or any thread holding the connector's lock) calls every method.

Memory: node state lives in numpy arrays indexed by slot; the only per-node
Python objects are the key bytes and its dict entry.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sessionkv.types import TIERS, Tier

from .views import Resolved, SessionSummary, alias64

__all__ = ["SessionPrefixIndex", "Resolved", "SessionSummary", "alias64"]

G1Probe = Callable[[Sequence[bytes]], Sequence[int]]
_NONE = -1
_MAX_COPIES = int(np.iinfo(np.uint16).max)
# Copy updates of at most this many keys run per key in Python, larger ones
# in numpy (the cheaper side of each, measured by bench/scale.py's steps).
FEW_KEYS = 16


@dataclass
class _Session:
    frontiers: set[int] = field(default_factory=set)
    last_access: float = 0.0


class SessionPrefixIndex:
    """Engine-side session topology and residency (see the module docstring)."""

    def __init__(
        self,
        *,
        g1_probe: G1Probe | None = None,
        idle_timeout_s: float | None = None,
        max_tombstones: int = 10_000,
        initial_capacity: int = 1024,
    ):
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s!r}")
        if max_tombstones < 0:
            raise ValueError(f"max_tombstones must be >= 0, got {max_tombstones!r}")
        self._g1_probe = g1_probe
        self._idle_timeout_s = idle_timeout_s
        self._max_tombstones = max_tombstones
        cap = max(16, initial_capacity)
        self._slot: dict[bytes, int] = {}
        self._alias: dict[int, int] = {}             # alias64(key) -> slot
        self._keys: list[bytes | None] = []
        self._free: list[int] = []
        self._parent = np.full(cap, _NONE, np.int32)
        self._depth = np.zeros(cap, np.int32)
        self._nchild = np.zeros(cap, np.int32)
        self._copies = np.zeros((len(TIERS), cap), np.uint16)
        self._total = np.zeros(cap, np.uint32)      # copies over all tiers
        self._sessions: dict[str, _Session] = {}
        self._frontier_of: dict[int, set[str]] = {}
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._sweep_cursor = 0

    # ------------------------------------------------------------------ slots

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def _grow(self, need: int) -> None:
        cap = len(self._parent)
        if need <= cap:
            return
        new = max(need, cap * 2)
        self._parent = np.concatenate([self._parent, np.full(new - cap, _NONE, np.int32)])
        self._depth = np.concatenate([self._depth, np.zeros(new - cap, np.int32)])
        self._nchild = np.concatenate([self._nchild, np.zeros(new - cap, np.int32)])
        self._copies = np.concatenate(
            [self._copies, np.zeros((len(TIERS), new - cap), np.uint16)], axis=1)
        self._total = np.concatenate([self._total, np.zeros(new - cap, np.uint32)])

    def _alloc(self, n: int) -> list[int]:
        reuse = self._free[-n:] if n else []
        del self._free[len(self._free) - len(reuse):]
        fresh = n - len(reuse)
        start = len(self._keys)
        if fresh:
            self._grow(start + fresh)
            self._keys.extend([None] * fresh)
        return reuse[::-1] + list(range(start, start + fresh))

    def _resident(self, slot: int) -> bool:
        return self._total[slot] != 0

    def _recount(self, idx: np.ndarray) -> None:
        self._total[idx] = self._copies[:, idx].sum(axis=0, dtype=np.uint32)

    # -------------------------------------------------------------- mutation

    def admit(
        self,
        session: str | None,
        chain: Sequence[bytes],
        tier: Tier | None = None,
        start: int = 0,
        now: float = 0.0,
    ) -> None:
        """Record a request's block chain, ``chain[0]`` being a child of the root.

        Missing nodes are linked in; ``chain[start:]`` get a copy in ``tier``
        (at least one: a copy already counted is not counted twice); the
        session's branch moves to the deepest resident key of the chain. Use it
        for cache hits (no ``tier``: membership only), full-block admission and
        decode-block completion (``tier=G1``, ``start`` = first new block).
        """
        self._admit(session, chain, tier, start, now)

    def extend(self, session: str | None, parent: bytes, keys: Sequence[bytes], tier: Tier,
               now: float = 0.0) -> bool:
        """``admit`` of a chain's next blocks: ``keys`` are the children of
        ``parent``, each gets a copy in ``tier``. It touches only ``keys``
        and the session's frontiers, so a step's admission costs the blocks
        it adds, not the context (``admit`` looks up the whole chain). False,
        with nothing done, when ``parent`` is no longer indexed (pruned): the
        caller admits the whole chain instead."""
        p = self._slot.get(parent)
        if p is not None:
            self._admit(session, keys, tier, 0, now, p, int(self._depth[p]) + 1)
        return p is not None

    def _admit(self, session: str | None, chain: Sequence[bytes], tier: Tier | None,
               start: int, now: float, root: int = _NONE, base: int = 0) -> None:
        """``admit`` of ``chain`` below node ``root`` (the tree's root by
        default), ``chain[0]`` at depth ``base``."""
        n = len(chain)
        if n == 0:
            return
        slots = list(map(self._slot.get, chain))
        try:
            first_new = slots.index(None)
        except ValueError:
            first_new = n
        if first_new < n:
            self._link(chain, slots, first_new, root, base)
        if tier is not None and start < n:
            row = self._copies[tier]
            if n - start <= FEW_KEYS:       # a decode step's block: per key (FEW_KEYS)
                total = self._total
                for s in slots[start:]:
                    if row[s] == 0:
                        row[s] = 1
                        total[s] += 1
            else:
                idx = np.asarray(slots[start:], np.int64)
                row[idx] = np.maximum(row[idx], 1)
                self._recount(idx)
        # The deepest resident key: the tail, unless keys were linked without a copy.
        tail = n - 1
        while tail >= 0 and not self._resident(slots[tail]):
            tail -= 1
        if tail < n - 1:
            self._prune(slots[-1])
        if session is not None:
            self._touch_session(session, now)
            if tail >= 0:
                self._extend_branch(session, slots, tail, base, root)

    def _link(self, chain: Sequence[bytes], slots: list, first_new: int,
              root: int = _NONE, base: int = 0) -> None:
        """Link ``chain[first_new:]`` in; ``chain[0]`` is a child of ``root``
        (the tree's root by default) at depth ``base``."""
        n = len(chain)
        # Chained hashes make every descendant of a missing node missing too.
        if slots.count(None) != n - first_new:
            raise ValueError("chain holds a known key below an unknown one: not a prefix chain")
        new = self._alloc(n - first_new)
        parent = slots[first_new - 1] if first_new else root
        if len(new) <= FEW_KEYS:
            self._link_few(new, parent, base + first_new)
        else:
            self._link_many(new, parent, base + first_new)
        new_keys = chain[first_new:]
        for s, k in zip(new, new_keys):
            self._keys[s] = k
        self._slot.update(zip(new_keys, new))
        self._alias.update(zip(map(alias64, new_keys), new))
        slots[first_new:] = new

    def _link_few(self, new: list[int], parent: int, depth: int) -> None:
        """The arrays of ``_link`` per slot (numpy's per-call cost, FEW_KEYS)."""
        par, dep, nchild, copies, total = (self._parent, self._depth, self._nchild,
                                           self._copies, self._total)
        for s in new:
            par[s] = parent
            dep[s] = depth
            nchild[s] = 0
            copies[:, s] = 0
            total[s] = 0
            if parent != _NONE:
                nchild[parent] += 1
            parent, depth = s, depth + 1

    def _link_many(self, new: list[int], parent: int, depth: int) -> None:
        idx = np.asarray(new, np.int64)
        self._parent[idx] = [parent, *new[:-1]]
        self._depth[idx] = np.arange(depth, depth + len(new), dtype=np.int32)
        self._nchild[idx] = 1
        self._nchild[new[-1]] = 0
        self._copies[:, idx] = 0
        self._total[idx] = 0
        if parent != _NONE:
            self._nchild[parent] += 1

    def _touch_session(self, session: str, now: float) -> _Session:
        if self._sessions:
            now = max(now, self._sessions[next(reversed(self._sessions))].last_access)
        st = self._sessions.pop(session, None)    # back in at the end: access order
        if st is None:
            st = _Session()
            self._tombstones.pop(session, None)   # a new request reopens it
        st.last_access = max(st.last_access, now)
        self._sessions[session] = st
        return st

    def _ancestor_at(self, slot: int, depth: int) -> int:
        parent, d = self._parent, int(self._depth[slot])
        while d > depth:
            slot = int(parent[slot])
            d -= 1
        return slot

    def _extend_branch(self, session: str, slots: list, tail: int, base: int = 0,
                       above: int = _NONE) -> None:
        """Make ``slots[tail]`` a frontier of the session, unless a branch
        already covers it; frontiers on the chain above it are superseded.
        ``slots`` start at depth ``base``, below node ``above`` (``extend``):
        a frontier above them is found by a walk from ``above``, none for the
        frontier the chain's last admission left there."""
        st = self._sessions[session]
        t, deepest = slots[tail], base + tail
        depth = self._depth
        for f in list(st.frontiers):
            d = int(depth[f])
            if d <= deepest:
                if (slots[d - base] if d >= base else self._ancestor_at(above, d)) == f:
                    if f != t:
                        self._drop_frontier(session, st, f)
            elif self._ancestor_at(f, deepest) == t:
                return
        self._put_frontier(session, st, t)

    def _add_frontier(self, session: str, st: _Session, t: int) -> None:
        """``_extend_branch`` for a node known only by its slot (a walk per frontier)."""
        d = int(self._depth[t])
        for f in list(st.frontiers):
            df = int(self._depth[f])
            if df >= d and self._ancestor_at(f, d) == t:
                return
            if df < d and self._ancestor_at(t, df) == f:
                self._drop_frontier(session, st, f)
        self._put_frontier(session, st, t)

    def _put_frontier(self, session: str, st: _Session, t: int) -> None:
        st.frontiers.add(t)
        self._frontier_of.setdefault(t, set()).add(session)

    def _drop_frontier(self, session: str, st: _Session, f: int) -> None:
        st.frontiers.discard(f)
        owners = self._frontier_of.get(f)
        if owners is not None:
            owners.discard(session)
            if not owners:
                del self._frontier_of[f]

    def set_copies(self, tier: Tier, keys: Sequence[bytes], counts: int | Sequence[int]) -> None:
        """Set the copy count of ``keys`` in ``tier`` (one count for all, or one
        per key). Keys the index does not hold are ignored: without their
        chain there is no place for them in the tree."""
        self._update(tier, keys, counts, absolute=True)

    def add_copies(self, tier: Tier, keys: Sequence[bytes], delta: int = 1) -> None:
        """Add ``delta`` (negative to remove) copies of ``keys`` in ``tier``;
        counts never go below zero. Unknown keys are ignored."""
        self._update(tier, keys, delta, absolute=False)

    def _update(self, tier: Tier, keys: Sequence[bytes], value, absolute: bool) -> None:
        slots = list(map(self._slot.get, keys))
        if isinstance(value, int):
            pairs = [(s, value) for s in slots if s is not None]
        else:
            if len(value) != len(keys):
                raise ValueError("one count per key")
            pairs = [(s, v) for s, v in zip(slots, value) if s is not None]
        if not pairs:
            return
        if len(pairs) <= FEW_KEYS:
            self._update_few(tier, pairs, absolute)
            return
        idx = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        vals = np.fromiter((v for _, v in pairs), np.int64, len(pairs))
        before = self._total[idx] != 0
        row = self._copies[tier]
        if absolute:
            row[idx] = np.clip(vals, 0, _MAX_COPIES)
        else:
            # Sequential semantics, a key named twice counts twice; clamped at
            # zero after each step, as a per-key loop would.
            for s, v in pairs:
                row[s] = min(max(int(row[s]) + v, 0), _MAX_COPIES)
        self._recount(idx)
        gone = idx[before & (self._total[idx] == 0)]
        if gone.size:
            self._on_gone(np.unique(gone).tolist())

    def _update_few(self, tier: Tier, pairs: list[tuple[int, int]], absolute: bool) -> None:
        """``_update`` of a few slots, per slot: numpy's per-call overhead
        (about 50 us for the fromiter/clip/recount above) is most of what a
        decode step's G2 store or a status summary costs with four or five
        keys. Same semantics: sequential per key, a slot is gone when it had
        a copy before the call and has none after."""
        row, total = self._copies[tier], self._total
        before: dict[int, bool] = {}
        for s, v in pairs:
            if s not in before:
                before[s] = total[s] != 0
            old = int(row[s])
            new = min(max(v if absolute else old + v, 0), _MAX_COPIES)
            row[s] = new
            total[s] = int(total[s]) - old + new
        gone = sorted(s for s, had in before.items() if had and total[s] == 0)
        if gone:
            self._on_gone(gone)

    def _on_gone(self, gone: list[int]) -> None:
        """Nodes that lost their last copy: retreat their frontiers, then prune."""
        parent = self._parent
        for s in gone:
            owners = self._frontier_of.pop(s, None)
            if not owners:
                continue
            a = int(parent[s])
            while a != _NONE and not self._resident(a):
                a = int(parent[a])
            for session in owners:
                st = self._sessions[session]
                st.frontiers.discard(s)
                if a != _NONE:
                    self._add_frontier(session, st, a)
        order = np.asarray(gone, np.int64)
        order = order[np.argsort(-self._depth[order], kind="stable")].tolist()
        keys = self._keys
        for s in order:
            if keys[s] is not None:
                self._prune(s)

    def _covers(self, st: _Session, slot: int) -> bool:
        """Whether ``slot`` is an ancestor-or-self of one of the frontiers."""
        d = int(self._depth[slot])
        return any(int(self._depth[f]) >= d and self._ancestor_at(f, d) == slot
                   for f in st.frontiers)

    def _prune(self, s: int) -> None:
        """Remove ``s`` and its ancestors while each has no copy, no child and
        is no frontier."""
        nchild, total, parent, keys = self._nchild, self._total, self._parent, self._keys
        frontier_of, slot_of, free = self._frontier_of, self._slot, self._free
        while s != _NONE and nchild[s] == 0 and total[s] == 0 and s not in frontier_of:
            p = int(parent[s])
            del slot_of[keys[s]]
            if self._alias.get(a := alias64(keys[s])) == s:
                del self._alias[a]
            keys[s] = None
            parent[s] = _NONE
            free.append(s)
            if p != _NONE:
                nchild[p] -= 1
            s = p

    def clear_tier(self, tier: Tier) -> None:
        """Every copy in ``tier`` is gone (the tier was reset)."""
        held = np.flatnonzero(self._copies[tier])
        if held.size:
            self.set_copies(tier, [self._keys[s] for s in held.tolist()], 0)

    def bind_g1_probe(self, probe: G1Probe | None) -> None:
        """Set the G1 probe once vLLM's block pool is known."""
        self._g1_probe = probe

    def chain_to(self, key: bytes, n: int) -> list[bytes]:
        """``key`` and its ancestors, at most ``n`` keys, root side first: the
        blocks of the chunk an offloaded chunk key (its last block) names."""
        s = self._slot.get(key)
        out: list[bytes] = []
        while s is not None and s != _NONE and len(out) < n:
            out.append(self._keys[s])
            s = int(self._parent[s])
        return out[::-1]

    # ------------------------------------------------------------- sessions

    def end_session(self, session: str, now: float = 0.0) -> bool:
        """End a session: drop its branches and remember it as a tombstone
        (bounded). The blocks stay while they have copies. Whether it existed."""
        st = self._sessions.pop(session, None)
        if st is None:
            return False
        for f in st.frontiers:
            owners = self._frontier_of[f]
            owners.discard(session)
            if not owners:
                del self._frontier_of[f]
                if not self._resident(f):     # unreachable by the invariant; be safe
                    self._prune(f)
        self._tombstones[session] = now
        self._tombstones.move_to_end(session)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
        return True

    def expire(self, now: float, max_sessions: int | None = None) -> list[str]:
        """End the sessions idle for longer than ``idle_timeout_s``, at most
        ``max_sessions`` of them (the oldest first); their ids."""
        if self._idle_timeout_s is None:
            return []
        limit = now - self._idle_timeout_s
        idle = []
        for s, st in self._sessions.items():      # oldest first
            if st.last_access >= limit or len(idle) == max_sessions:
                break
            idle.append(s)
        for s in idle:
            self.end_session(s, now)
        return idle

    def has_session(self, session: str) -> bool:
        return session in self._sessions

    def is_ended(self, session: str) -> bool:
        """Whether the session ended recently (its tombstone is still kept)."""
        return session in self._tombstones

    def sessions(self) -> list[str]:
        return list(self._sessions)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def recent_sessions(self, n: int) -> list[str]:
        """The ``n`` sessions accessed last, the most recent first."""
        return list(itertools.islice(reversed(self._sessions), max(n, 0)))

    # --------------------------------------------------------------- queries

    def sweep_g1(self, max_slots: int | None = None) -> int:
        """Re-read G1 copy counts from ``g1_probe`` for the nodes believed in
        G1 among the next ``max_slots`` slots (all when None), round robin.
        vLLM reports no G1 evictions, so the owner calls this with a small
        budget once per step to prune what G1 dropped; queries refresh their
        own nodes. Costs O(max_slots). Returns how many nodes were probed."""
        n = len(self._keys)
        if self._g1_probe is None or n == 0:
            return 0
        lo = self._sweep_cursor if self._sweep_cursor < n else 0
        hi = n if max_slots is None else min(n, lo + max_slots)
        self._sweep_cursor = hi
        held = (lo + np.flatnonzero(self._copies[Tier.G1, lo:hi])).tolist()
        self._refresh_g1(held)
        return len(held)

    def _refresh_g1(self, slots: Iterable[int]) -> None:
        if self._g1_probe is None:
            return
        keys = [self._keys[s] for s in slots]
        if keys:
            self.set_copies(Tier.G1, keys, list(self._g1_probe(keys)))

    def _paths(self, frontiers: Iterable[int]) -> list[int]:
        """Every node on the paths from the root to ``frontiers``, once."""
        seen: set[int] = set()
        parent = self._parent
        for f in frontiers:
            s = f
            while s != _NONE and s not in seen:
                seen.add(s)
                s = int(parent[s])
        return list(seen)

    def _result(self, slots: Iterable[int]) -> Resolved:
        slots = [s for s in slots if self._keys[s] is not None and self._resident(s)]
        slots.sort(key=lambda s: (int(self._depth[s]), self._keys[s]))
        keys = [self._keys[s] for s in slots]
        per_tier = {t: [k for s, k in zip(slots, keys) if self._copies[t, s] > 0] for t in TIERS}
        return Resolved(keys, per_tier)

    def frontiers(self, session: str) -> list[bytes] | None:
        """A session's branch tips (None for an unknown session)."""
        st = self._sessions.get(session)
        if st is None:
            return None
        self._refresh_g1(self._paths(st.frontiers))
        return sorted(self._keys[f] for f in st.frontiers)

    def deepest_branch(self, session: str) -> bytes | None:
        """The frontier key of the session's deepest branch (None when it has
        none): its current chain, as a session's prompts grow."""
        st = self._sessions.get(session)
        if st is None or not st.frontiers:
            return None
        depth, keys = self._depth, self._keys
        return keys[max(st.frontiers, key=lambda f: (int(depth[f]), keys[f]))]

    def resolve_session(
        self, session: str, branch: bytes | None = None, boundary: bytes | None = None
    ) -> Resolved | None:
        """Resident blocks of a session: all of it, one branch (named by its
        frontier key), or its prefix up to ``boundary``. None when the session
        is unknown, or the branch or boundary is not part of it."""
        st = self._sessions.get(session)
        if st is None:
            return None
        self._refresh_g1(self._paths(st.frontiers))
        st = self._sessions.get(session)
        if st is None:
            return None
        if branch is not None:
            s = self._slot.get(branch)
            if s is None or s not in st.frontiers:
                return None
            return self._result(self._paths([s]))
        if boundary is not None:
            s = self._slot.get(boundary)
            if s is None or not self._covers(st, s):
                return None
            return self._result(self._paths([s]))
        return self._result(self._paths(st.frontiers))

    def chunk_keys(self, keys: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
        """The keys among ``keys`` that end a chunk (G2 and G3 name chunks by
        their last block): depth + 1 a multiple of ``blocks_per_chunk``.
        Unknown keys are dropped."""
        if blocks_per_chunk == 1:
            return [k for k in keys if k in self._slot]
        depth = self._depth
        return [k for k in keys if (s := self._slot.get(k)) is not None
                and (int(depth[s]) + 1) % blocks_per_chunk == 0]

    def resolve_keys(self, keys: Sequence[bytes]) -> Resolved:
        """Which of exactly these keys are resident, per tier."""
        slots = [s for s in map(self._slot.get, keys) if s is not None]
        self._refresh_g1(slots)
        return self._result(s for s in map(self._slot.get, keys) if s is not None)

    def resolve_aliases(self, aliases: Sequence[int]) -> Resolved:
        """``resolve_keys`` for blocks named by their 64-bit aliases (KV
        events' block hashes, KVCR's ``kv.fetch``); unknown aliases are dropped."""
        slot_of = self._alias.get
        return self.resolve_keys([self._keys[s] for s in map(slot_of, aliases) if s is not None])

    def sessions_of(self, key: bytes) -> list[str]:
        """Sessions whose branches pass through ``key`` (sorted)."""
        s = self._slot.get(key)
        if s is None:
            return []
        return sorted(name for name, st in self._sessions.items() if self._covers(st, s))

    def copies(self, key: bytes) -> dict[Tier, int] | None:
        """Copy counts of one key (None when the index does not hold it)."""
        s = self._slot.get(key)
        if s is None:
            return None
        return {t: int(self._copies[t, s]) for t in TIERS}

    def summary(self, session: str) -> SessionSummary | None:
        """A session's counts (G1 refreshed first), without the sorted key
        lists ``resolve_session`` builds: a status view summarizes many."""
        st = self._sessions.get(session)
        if st is None:
            return None
        self._refresh_g1(self._paths(st.frontiers))
        st = self._sessions.get(session)
        if st is None:
            return None
        slots = self._paths(st.frontiers)
        idx = np.fromiter(slots, np.int64, len(slots))
        held = np.count_nonzero(self._copies[:, idx], axis=1)
        return SessionSummary(
            session_id=session,
            frontiers=sorted(self._keys[f] for f in st.frontiers),
            blocks=int(np.count_nonzero(self._total[idx])),
            per_tier={t: int(held[t]) for t in TIERS},
            last_access=st.last_access,
        )
