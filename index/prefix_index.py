"""SessionPrefixIndex: which logical KV blocks each session holds, and where.

The blocks are the nodes of a ``BlockTree`` (``index/tree.py``): the prefix
tree that chained block hashes define, with copy counts per tier (G1, G2, G3).
This module owns the sessions over it. A session is a set of *frontier* nodes,
one per concurrent branch; its members are the resident nodes on the paths
from the root to its frontiers. One session has many branches, one block
belongs to many sessions, one key may have several copies.

Invariants, kept by every operation:

- a frontier is resident (has a copy in some tier). When its last copy goes,
  the frontier retreats to the nearest resident ancestor, or the branch is
  removed when there is none or when another branch of the session already
  covers that ancestor;
- no frontier is an ancestor of another frontier of the same session;
- every node is resident, a frontier, or a branch point: a node with no
  copy is pruned when nothing below it is resident, and spliced out of its
  chain when one child is (``BlockTree.prune``), so the index holds what is
  resident, not each session's whole history;
- sessions are kept in order of last access, oldest first, and an access is
  dated no earlier than the newest before it (the callers' clocks are
  monotonic): idle expiry and ``recent_sessions`` cost what they return, not
  a pass over every session.

G1 copies have no eviction callback in vLLM, so G1 residency is refreshed
lazily: a query first asks ``g1_probe`` (the connector's view of vLLM's block
pool) for the G1 copy counts of the nodes it is about to report.

Threading: not thread-safe. One owner (the connector, on vLLM's scheduler
thread, or any thread holding the connector's lock) calls every method.

Memory: the tree's (arrays of numbers per node, key bytes and two dict entries),
plus a set per session and a dict entry per frontier.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from sessionkv.index.tree import FEW_KEYS, MAX_COPIES, NONE, BlockTree, view
from sessionkv.index.views import Resolved, SessionSummary, alias64
from sessionkv.types import TIERS, Tier

__all__ = ["SessionPrefixIndex", "Resolved", "SessionSummary", "alias64"]

G1Probe = Callable[[Sequence[bytes]], Sequence[int]]
# A G1 sweep window up to this many slots is read in Python, a larger one by numpy.
G1_SWEEP_FEW = 256


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
        self._tree = BlockTree(initial_capacity)
        self._sessions: dict[str, _Session] = {}
        self._frontier_of: dict[int, set[str]] = {}
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        self._sweep_cursor = 0

    def __len__(self) -> int:
        return len(self._tree.slot)

    def __contains__(self, key: bytes) -> bool:
        return key in self._tree.slot

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

    def extend(
        self,
        session: str | None,
        parent: bytes,
        keys: Sequence[bytes],
        tier: Tier,
        now: float = 0.0,
    ) -> bool:
        """``admit`` of a chain's next blocks: ``keys`` are the children of
        ``parent``, each gets a copy in ``tier``. It touches only ``keys``
        and the session's frontiers, so a step's admission costs the blocks
        it adds, not the context (``admit`` looks up the whole chain). False,
        with nothing done, when ``parent`` is no longer indexed (pruned): the
        caller admits the whole chain instead."""
        return not self.extend_each([(session, parent, keys)], tier, now)

    def extend_each(
        self,
        items: Sequence[tuple[str | None, bytes, Sequence[bytes]]],
        tier: Tier,
        now: float = 0.0,
    ) -> list[int]:
        """``extend`` of each ``(session, parent, keys)``, in order, in one
        call (a scheduler step's filled blocks); the positions of the items
        whose parent is no longer indexed, which did nothing."""
        tree = self._tree
        slot, frontier_of, add_leaf = tree.slot, self._frontier_of, tree.add_leaf
        sessions = self._sessions
        if sessions:  # no earlier than the latest access (``_touch_session``)
            now = max(now, sessions[next(reversed(sessions))].last_access)
        missing = []
        for i, (session, parent, keys) in enumerate(items):
            p = slot.get(parent)
            if p is None:
                missing.append(i)
                continue
            owners = frontier_of.get(p)
            if len(keys) == 1 and owners is not None and session in owners and keys[0] not in slot:
                # A decode step's block below the session's frontier: the
                # frontier moves down to it (what ``_admit`` concludes, in a
                # few dict and array writes: 16 a step at 256 x 64k).
                s = add_leaf(keys[0], p, tier)
                # a frontier's owner is live (the invariants): touched in place
                st = sessions.pop(session, None) or self._touch_session(session, now)
                sessions[session] = st
                st.last_access = now
                st.frontiers.discard(p)
                st.frontiers.add(s)
                del frontier_of[p]
                if len(owners) == 1:  # the session's own: the set moves down
                    frontier_of[s] = owners
                else:
                    owners.discard(session)
                    frontier_of[p] = owners
                    frontier_of[s] = {session}
                continue
            self._admit(session, keys, tier, 0, now, p, tree.depth[p] + 1)
        return missing

    def _admit(
        self,
        session: str | None,
        chain: Sequence[bytes],
        tier: Tier | None,
        start: int,
        now: float,
        root: int = NONE,
        base: int = 0,
    ) -> None:
        """``admit`` of ``chain`` below node ``root`` (the tree's root by
        default), ``chain[0]`` at depth ``base``."""
        n = len(chain)
        if n == 0:
            return
        tree = self._tree
        slots = list(map(tree.slot.get, chain))
        # New keys above ``start`` get no copy: linked in, then out again.
        uncopied = (
            [i for i, s in enumerate(slots[:start]) if s is None]
            if tier is not None and start and None in slots[:start]
            else ()
        )
        relinked, moved = tree.attach(chain, slots, root, base)
        linked = cast("list[int]", slots)  # ``attach`` linked every missing key
        if moved:
            self._merge_branches(moved)
        if tier is not None and start < n:
            tree.set_one(tier, linked[start:] if start else linked)
        # The deepest resident key: the tail, unless keys were linked without a copy.
        total = tree.total
        tail = n - 1
        while tail >= 0 and total[linked[tail]] == 0:
            tail -= 1
        if tail < n - 1:
            tree.prune(linked[-1], self._frontier_of)
        if session is not None:
            self._touch_session(session, now)
            if tail >= 0:
                self._extend_branch(session, linked, tail, base, root)
        for s in [*relinked, *(linked[i] for i in uncopied)]:  # linked in with no copy
            if tree.keys[s] is not None and total[s] == 0:
                tree.prune(s, self._frontier_of)

    def _merge_branches(self, moved: list[tuple[int, int]]) -> None:
        """Known nodes got their spliced-out ancestors back (``BlockTree.attach``):
        a frontier on the new path above one of them, of a session with a
        frontier below it, no longer tips a branch of its own (rare: a
        spliced key came back as a leaf, then its old descendants' chain)."""
        tree, frontier_of = self._tree, self._frontier_of
        depth, parent, ancestor_at = tree.depth, tree.parent, tree.ancestor_at
        for b, old in moved:
            d = int(depth[b])
            u = int(parent[b])
            while u != NONE and u != old:
                for session in list(frontier_of.get(u, ())):
                    st = self._sessions[session]
                    if any(int(depth[f]) >= d and ancestor_at(f, d) == b for f in st.frontiers):
                        self._drop_frontier(session, st, u)
                u = int(parent[u])

    def _touch_session(self, session: str, now: float) -> _Session:
        sessions = self._sessions
        if sessions:
            now = max(now, sessions[next(reversed(sessions))].last_access)
        st = sessions.pop(session, None)  # back in at the end: access order
        if st is None:
            st = _Session()
            self._tombstones.pop(session, None)  # a new request reopens it
        sessions[session] = st
        if now > st.last_access:
            st.last_access = now
        return st

    def _extend_branch(
        self, session: str, slots: list[int], tail: int, base: int = 0, above: int = NONE
    ) -> None:
        """Make ``slots[tail]`` a frontier of the session, unless a branch
        already covers it; frontiers on the chain above it are superseded.
        ``slots`` start at depth ``base``, below node ``above`` (``extend``):
        a frontier above them is found by a walk from ``above``, none for the
        frontier the chain's last admission left there."""
        st = self._sessions[session]
        t, deepest = slots[tail], base + tail
        depth, ancestor_at = self._tree.depth, self._tree.ancestor_at
        for f in list(st.frontiers):
            d = int(depth[f])
            if d <= deepest:
                if (slots[d - base] if d >= base else ancestor_at(above, d)) == f:
                    if f != t:
                        self._drop_frontier(session, st, f)
            elif ancestor_at(f, deepest) == t:
                return
        self._put_frontier(session, st, t)

    def _add_frontier(self, session: str, st: _Session, t: int) -> None:
        """``_extend_branch`` for a node known only by its slot (a walk per frontier)."""
        depth, ancestor_at = self._tree.depth, self._tree.ancestor_at
        d = int(depth[t])
        for f in list(st.frontiers):
            df = int(depth[f])
            if df >= d and ancestor_at(f, d) == t:
                return
            if df < d and ancestor_at(t, df) == f:
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
        if isinstance(counts, int):
            # One count for all: a store's G2 copies, an eviction's (a decode
            # step at 256 x 64k has about 16 of each, most of one key).
            if len(keys) == 1:  # without the lists of ``set_each``
                for key in keys:
                    s = self._tree.slot.get(key)
                    if s is not None and self._tree.put(tier, s, min(max(counts, 0), MAX_COPIES)):
                        self._on_gone([s])
                return
            get = self._tree.slot.get
            gone = self._tree.set_each(tier, [s for s in map(get, keys) if s is not None], counts)
            if gone:
                self._on_gone(gone)
            return
        self._update(tier, keys, counts, absolute=True)

    def add_copies(self, tier: Tier, keys: Sequence[bytes], delta: int = 1) -> None:
        """Add ``delta`` (negative to remove) copies of ``keys`` in ``tier``;
        counts never go below zero. Unknown keys are ignored."""
        self._update(tier, keys, delta, absolute=False)

    def _update(
        self, tier: Tier, keys: Sequence[bytes], value: int | Sequence[int], absolute: bool
    ) -> None:
        slots = list(map(self._tree.slot.get, keys))
        if isinstance(value, int):
            pairs = [(s, value) for s in slots if s is not None]
        else:
            if len(value) != len(keys):
                raise ValueError("one count per key")
            pairs = [(s, v) for s, v in zip(slots, value) if s is not None]
        if pairs:
            gone = self._tree.update(tier, pairs, absolute)
            if gone:
                self._on_gone(gone)

    def _on_gone(self, gone: list[int]) -> None:
        """Nodes that lost their last copy: retreat their frontiers, then prune."""
        tree = self._tree
        for s in gone:
            owners = self._frontier_of.pop(s, None)
            if not owners:
                continue
            a = tree.nearest_resident_above(s)
            for session in owners:
                st = self._sessions[session]
                st.frontiers.discard(s)
                if a != NONE:
                    self._add_frontier(session, st, a)
        # Deepest first (stable): a step's evictions in Python, a reset's in numpy.
        order: list[int]
        if len(gone) <= FEW_KEYS:
            depth = tree.depth
            order = sorted(gone, key=lambda s: -depth[s])
        else:
            idx = np.asarray(gone, np.int64)
            order = idx[np.argsort(-view(tree.depth)[idx], kind="stable")].tolist()
        keys = tree.keys
        for s in order:
            if keys[s] is not None:
                tree.prune(s, self._frontier_of)

    def _covers(self, st: _Session, slot: int) -> bool:
        """Whether ``slot`` is an ancestor-or-self of one of the frontiers."""
        depth, ancestor_at = self._tree.depth, self._tree.ancestor_at
        d = int(depth[slot])
        return any(int(depth[f]) >= d and ancestor_at(f, d) == slot for f in st.frontiers)

    def clear_tier(self, tier: Tier) -> None:
        """Every copy in ``tier`` is gone (the tier was reset)."""
        held = self._tree.held(tier)
        if held:
            self.set_copies(tier, held, 0)

    def bind_g1_probe(self, probe: G1Probe | None) -> None:
        """Set the G1 probe once vLLM's block pool is known."""
        self._g1_probe = probe

    def reserve(self, nodes: int) -> None:
        """Room for ``nodes`` nodes before the tree grows: a growth copies
        every array inside the step that needs it (1.9 ms at 65,536 nodes,
        the first decode step of bench/scale.py's 256 x 4k)."""
        self._tree.reserve(nodes)

    def chain_to(self, key: bytes, n: int) -> list[bytes]:
        """``key`` and its ancestors, at most ``n`` keys, root side first: the
        blocks of the chunk an offloaded chunk key (its last block) names."""
        return self._tree.chain_to(key, n)

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
                if self._tree.total[f] == 0:  # unreachable by the invariant; be safe
                    self._tree.prune(f, self._frontier_of)
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
        idle: list[str] = []
        for s, st in self._sessions.items():  # oldest first
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
        n = len(self._tree.keys)
        if self._g1_probe is None or n == 0:
            return 0
        lo = self._sweep_cursor if self._sweep_cursor < n else 0
        hi = n if max_slots is None else min(n, lo + max_slots)
        self._sweep_cursor = hi
        # A step's window is a few dozen slots, read in Python (flatnonzero's
        # own overhead was most of a 16-slot sweep).
        row = self._tree.copies[Tier.G1]
        if hi - lo > G1_SWEEP_FEW:
            held = (lo + np.flatnonzero(view(row)[lo:hi])).tolist()
        else:
            held = [i for i in range(lo, hi) if row[i]]
        self._refresh_g1(held)
        return len(held)

    def _refresh_g1(self, slots: Iterable[int]) -> None:
        if self._g1_probe is None:
            return
        slots = list(slots)
        keys_of = cast("list[bytes]", self._tree.keys)  # nodes and G1 holders are live
        keys = [keys_of[s] for s in slots]
        if not keys:
            return
        row = self._tree.copies[Tier.G1]
        # Only the changed counts: most nodes a sweep reads are still in G1.
        changed = [(k, c) for s, k, c in zip(slots, keys, self._g1_probe(keys)) if row[s] != c]
        if changed:
            self.set_copies(Tier.G1, [k for k, _ in changed], [c for _, c in changed])

    def _members(self, st: _Session) -> list[int]:
        """A session's nodes, G1 refreshed first (which may retreat its frontiers)."""
        self._refresh_g1(self._tree.paths(st.frontiers))
        return self._tree.paths(st.frontiers)

    def frontiers(self, session: str) -> list[bytes] | None:
        """A session's branch tips (None for an unknown session)."""
        st = self._sessions.get(session)
        if st is None:
            return None
        self._refresh_g1(self._tree.paths(st.frontiers))
        keys = cast("list[bytes]", self._tree.keys)  # frontiers are live
        return sorted(keys[f] for f in st.frontiers)

    def deepest_branch(self, session: str) -> bytes | None:
        """The frontier key of the session's deepest branch (None when it has
        none): its current chain, as a session's prompts grow."""
        st = self._sessions.get(session)
        if st is None or not st.frontiers:
            return None
        depth, keys = self._tree.depth, self._tree.keys
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
        tree = self._tree
        members = self._members(st)
        if branch is not None:
            s = tree.slot.get(branch)
            if s is None or s not in st.frontiers:
                return None
            return tree.result(tree.paths([s]))
        if boundary is not None:
            s = tree.slot.get(boundary)
            if s is None or not self._covers(st, s):
                return None
            return tree.result(tree.paths([s]))
        return tree.result(members)

    def chunk_keys(self, keys: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
        """The keys among ``keys`` that end a chunk (G2 and G3 name chunks by
        their last block): depth + 1 a multiple of ``blocks_per_chunk``.
        Unknown keys are dropped."""
        return self._tree.chunk_keys(keys, blocks_per_chunk)

    def resolve_keys(self, keys: Sequence[bytes]) -> Resolved:
        """Which of exactly these keys are resident, per tier."""
        slot_of = self._tree.slot.get
        self._refresh_g1([s for s in map(slot_of, keys) if s is not None])
        return self._tree.result(s for s in map(slot_of, keys) if s is not None)

    def build_aliases(self, max_slots: int | None = None) -> bool:
        """Build the map from 64-bit aliases to keys, ``max_slots`` slots a
        call (all when None), so that a caller holding a lock can let it go
        between calls; kept up to date from the first call. Whether it is
        complete. Until then admission costs no alias (``index/tree.py``)."""
        return self._tree.build_aliases(max_slots)

    def resolve_aliases(self, aliases: Sequence[int]) -> Resolved:
        """``resolve_keys`` for blocks named by their 64-bit aliases (KV
        events' block hashes, KVCR's ``kv.fetch``); unknown aliases are
        dropped. Completes the alias map first (``build_aliases``)."""
        self._tree.build_aliases()
        alias = self._tree.alias
        assert alias is not None  # built by the call above
        slot_of, keys = alias.get, cast("list[bytes]", self._tree.keys)  # aliased slots are live
        return self.resolve_keys([keys[s] for s in map(slot_of, aliases) if s is not None])

    def sessions_of(self, key: bytes) -> list[str]:
        """Sessions whose branches pass through ``key`` (sorted)."""
        s = self._tree.slot.get(key)
        if s is None:
            return []
        return sorted(name for name, st in self._sessions.items() if self._covers(st, s))

    def copies(self, key: bytes) -> dict[Tier, int] | None:
        """Copy counts of one key (None when the index does not hold it)."""
        return self._tree.copies_of(key)

    def summary(self, session: str) -> SessionSummary | None:
        """A session's counts (G1 refreshed first), without the sorted key
        lists ``resolve_session`` builds: a status view summarizes many."""
        st = self._sessions.get(session)
        if st is None:
            return None
        tree = self._tree
        slots = self._members(st)
        idx = np.fromiter(slots, np.int64, len(slots))
        keys = cast("list[bytes]", tree.keys)  # frontiers are live
        return SessionSummary(
            session_id=session,
            frontiers=sorted(keys[f] for f in st.frontiers),
            blocks=int(np.count_nonzero(view(tree.total)[idx])),
            per_tier={t: int(np.count_nonzero(view(tree.copies[t])[idx])) for t in TIERS},
            last_access=st.last_access,
        )
