"""BlockTree: the nodes of the SessionPrefixIndex and their copy counts.

A node is one logical block: vLLM's ``OffloadKey`` bytes (BlockHash + KV cache
group). Nodes form the prefix tree that chained block hashes define (parent
link, depth, child count); shared ancestors are stored once. Each node counts
its copies per tier (G1, G2, G3); a node is *resident* while it has a copy.
The tree knows nothing of sessions: ``SessionPrefixIndex`` owns them and says
which nodes are frontiers, which ``prune`` keeps.

Invariants: ``slot`` and ``keys`` are inverse maps over live slots; ``total``
is the sum of ``copies`` over tiers; ``nchild`` counts the live children;
``alias`` maps a key's 64-bit alias to its slot (the last key admitted under
an alias wins, and pruning a key drops only its own entry).

Threading: not thread-safe; its one owner is the SessionPrefixIndex.

Memory: node state lives in numpy arrays indexed by slot; the only per-node
Python objects are the key bytes and its two dict entries (key and alias).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import numpy as np

from sessionkv.types import TIERS, Tier

from .views import Resolved, alias64, aliases64

NONE = -1
MAX_COPIES = int(np.iinfo(np.uint16).max)
# Updates of at most this many keys run per key in Python, larger ones in
# numpy (the cheaper side of each, measured by bench/scale.py's steps).
FEW_KEYS = 16


class BlockTree:
    """Slots, tree links and copy counts of the index's nodes (see the module docstring).

    Its arrays are public to its owner, which reads them on hot paths; they
    are replaced when the tree grows, so read them from the tree each time."""

    def __init__(self, initial_capacity: int = 1024):
        cap = max(16, initial_capacity)
        self.slot: dict[bytes, int] = {}
        self.alias: dict[int, int] = {}             # alias64(key) -> slot
        self.keys: list[bytes | None] = []
        self._free: list[int] = []
        self.parent = np.full(cap, NONE, np.int32)
        self.depth = np.zeros(cap, np.int32)
        self.nchild = np.zeros(cap, np.int32)
        self.copies = np.zeros((len(TIERS), cap), np.uint16)
        self.total = np.zeros(cap, np.uint32)      # copies over all tiers

    def __len__(self) -> int:
        return len(self.slot)

    # ------------------------------------------------------------------ slots

    def _grow(self, need: int) -> None:
        cap = len(self.parent)
        if need <= cap:
            return
        more = max(need, cap * 2) - cap
        self.parent = np.concatenate([self.parent, np.full(more, NONE, np.int32)])
        self.depth = np.concatenate([self.depth, np.zeros(more, np.int32)])
        self.nchild = np.concatenate([self.nchild, np.zeros(more, np.int32)])
        self.copies = np.concatenate(
            [self.copies, np.zeros((len(TIERS), more), np.uint16)], axis=1)
        self.total = np.concatenate([self.total, np.zeros(more, np.uint32)])

    def _alloc(self, n: int) -> list[int]:
        reuse = self._free[-n:] if n else []
        del self._free[len(self._free) - len(reuse):]
        fresh = n - len(reuse)
        start = len(self.keys)
        if fresh:
            self._grow(start + fresh)
            self.keys.extend([None] * fresh)
        return reuse[::-1] + list(range(start, start + fresh))

    def link(self, chain: Sequence[bytes], slots: list, first_new: int,
             root: int = NONE, base: int = 0) -> None:
        """Link ``chain[first_new:]`` in (``slots`` holds ``chain``'s slots,
        None for the missing ones, and gets the new ones); ``chain[0]`` is a
        child of ``root`` (the tree's root by default) at depth ``base``."""
        n = len(chain)
        # Chained hashes make every descendant of a missing node missing too.
        if slots.count(None) != n - first_new:
            raise ValueError("chain holds a known key below an unknown one: not a prefix chain")
        fresh = not self._free                 # new slots are the list's end
        new = self._alloc(n - first_new)
        parent = slots[first_new - 1] if first_new else root
        if len(new) <= FEW_KEYS:
            self._link_few(new, parent, base + first_new)
        else:
            self._link_many(new, parent, base + first_new)
        new_keys = chain[first_new:]
        keys = self.keys
        if fresh:
            keys[new[0]:] = new_keys
        else:
            for s, k in zip(new, new_keys):
                keys[s] = k
        self.slot.update(zip(new_keys, new))
        self.alias.update(zip(aliases64(new_keys), new))
        slots[first_new:] = new

    def _link_few(self, new: list[int], parent: int, depth: int) -> None:
        """The arrays of ``link`` per slot (numpy's per-call cost, FEW_KEYS)."""
        par, dep, nchild, copies, total = (self.parent, self.depth, self.nchild,
                                           self.copies, self.total)
        for s in new:
            par[s] = parent
            dep[s] = depth
            nchild[s] = 0
            copies[:, s] = 0
            total[s] = 0
            if parent != NONE:
                nchild[parent] += 1
            parent, depth = s, depth + 1

    def _link_many(self, new: list[int], parent: int, depth: int) -> None:
        idx = np.asarray(new, np.int64)
        self.parent[idx] = [parent, *new[:-1]]
        self.depth[idx] = np.arange(depth, depth + len(new), dtype=np.int32)
        self.nchild[idx] = 1
        self.nchild[new[-1]] = 0
        self.copies[:, idx] = 0
        self.total[idx] = 0
        if parent != NONE:
            self.nchild[parent] += 1

    def prune(self, s: int, keep: Container[int]) -> None:
        """Remove ``s`` and its ancestors while each has no copy, no child and
        is not in ``keep`` (the frontiers)."""
        nchild, total, parent, keys = self.nchild, self.total, self.parent, self.keys
        slot_of, alias, free = self.slot, self.alias, self._free
        while s != NONE and nchild[s] == 0 and total[s] == 0 and s not in keep:
            p = int(parent[s])
            del slot_of[keys[s]]
            if alias.get(a := alias64(keys[s])) == s:
                del alias[a]
            keys[s] = None
            parent[s] = NONE
            free.append(s)
            if p != NONE:
                nchild[p] -= 1
            s = p

    # ---------------------------------------------------------------- copies

    def set_one(self, tier: Tier, slots: Sequence[int]) -> None:
        """At least one copy in ``tier`` for each of ``slots`` (a copy already
        counted is not counted twice)."""
        row, total = self.copies[tier], self.total
        if len(slots) <= FEW_KEYS:       # a decode step's block
            for s in slots:
                if row[s] == 0:
                    row[s] = 1
                    total[s] += 1
            return
        idx = np.asarray(slots, np.int64)
        row[idx] = np.maximum(row[idx], 1)
        self._recount(idx)

    def update(self, tier: Tier, pairs: list[tuple[int, int]], absolute: bool) -> list[int]:
        """Set (``absolute``) or add each ``(slot, value)``'s copies in
        ``tier``, per pair in order, clamped to ``[0, MAX_COPIES]`` after each;
        the slots that had a copy before and have none after (sorted, once)."""
        if len(pairs) <= FEW_KEYS:
            return self._update_few(tier, pairs, absolute)
        idx = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        vals = np.fromiter((v for _, v in pairs), np.int64, len(pairs))
        before = self.total[idx] != 0
        row = self.copies[tier]
        if absolute:
            row[idx] = np.clip(vals, 0, MAX_COPIES)
        else:
            # Sequential semantics, a key named twice counts twice; clamped at
            # zero after each step, as a per-key loop would.
            for s, v in pairs:
                row[s] = min(max(int(row[s]) + v, 0), MAX_COPIES)
        self._recount(idx)
        gone = idx[before & (self.total[idx] == 0)]
        return np.unique(gone).tolist() if gone.size else []

    def _update_few(self, tier: Tier, pairs: list[tuple[int, int]], absolute: bool) -> list[int]:
        """``update`` of a few slots, per slot: numpy's per-call overhead
        (about 50 us for the fromiter/clip/recount above) is most of what a
        decode step's G2 store or a status summary costs with four or five
        keys. Same semantics."""
        row, total = self.copies[tier], self.total
        before: dict[int, bool] = {}
        for s, v in pairs:
            if s not in before:
                before[s] = total[s] != 0
            old = int(row[s])
            new = min(max(v if absolute else old + v, 0), MAX_COPIES)
            row[s] = new
            total[s] = int(total[s]) - old + new
        return sorted(s for s, had in before.items() if had and total[s] == 0)

    def _recount(self, idx: np.ndarray) -> None:
        self.total[idx] = self.copies[:, idx].sum(axis=0, dtype=np.uint32)

    def held(self, tier: Tier) -> list[bytes]:
        """The keys with a copy in ``tier``."""
        return [self.keys[s] for s in np.flatnonzero(self.copies[tier]).tolist()]

    def copies_of(self, key: bytes) -> dict[Tier, int] | None:
        s = self.slot.get(key)
        if s is None:
            return None
        return {t: int(self.copies[t, s]) for t in TIERS}

    # ---------------------------------------------------------------- walks

    def ancestor_at(self, slot: int, depth: int) -> int:
        parent, d = self.parent, int(self.depth[slot])
        while d > depth:
            slot = int(parent[slot])
            d -= 1
        return slot

    def nearest_resident_above(self, s: int) -> int:
        """The closest resident ancestor of ``s`` (NONE when there is none)."""
        parent, total = self.parent, self.total
        a = int(parent[s])
        while a != NONE and total[a] == 0:
            a = int(parent[a])
        return a

    def paths(self, tips: Iterable[int]) -> list[int]:
        """Every node on the paths from the root to ``tips``, once."""
        seen: set[int] = set()
        parent = self.parent
        for f in tips:
            s = f
            while s != NONE and s not in seen:
                seen.add(s)
                s = int(parent[s])
        return list(seen)

    def chain_to(self, key: bytes, n: int) -> list[bytes]:
        """``key`` and its ancestors, at most ``n`` keys, root side first."""
        s = self.slot.get(key)
        out: list[bytes] = []
        while s is not None and s != NONE and len(out) < n:
            out.append(self.keys[s])
            s = int(self.parent[s])
        return out[::-1]

    def chunk_keys(self, keys: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
        """The known keys among ``keys`` whose depth + 1 is a multiple of
        ``blocks_per_chunk``: those that end a chunk."""
        if blocks_per_chunk == 1:
            return [k for k in keys if k in self.slot]
        depth = self.depth
        return [k for k in keys if (s := self.slot.get(k)) is not None
                and (int(depth[s]) + 1) % blocks_per_chunk == 0]

    def result(self, slots: Iterable[int]) -> Resolved:
        """The resident ones of ``slots`` as a ``Resolved`` (root side first, ties by key)."""
        keys_of, total = self.keys, self.total
        slots = [s for s in slots if keys_of[s] is not None and total[s] != 0]
        slots.sort(key=lambda s: (int(self.depth[s]), keys_of[s]))
        keys = [keys_of[s] for s in slots]
        per_tier = {t: [k for s, k in zip(slots, keys) if self.copies[t, s] > 0] for t in TIERS}
        return Resolved(keys, per_tier)
