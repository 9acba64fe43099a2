"""BlockTree: the nodes of the SessionPrefixIndex and their copy counts.

A node is one logical block: vLLM's ``OffloadKey`` bytes (BlockHash + KV cache
group). Nodes form the prefix tree that chained block hashes define (parent
link, depth, child count); shared ancestors are stored once. Each node counts
its copies per tier (G1, G2, G3); a node is *resident* while it has a copy.
The tree knows nothing of sessions: ``SessionPrefixIndex`` owns them and says
which nodes are frontiers, which ``prune`` keeps.

Only what can matter is kept: a node with no copy that is not kept is removed
when it has no child, and spliced out when it has one (its child's parent
becomes its own). Without the splice a long session whose early blocks left
every tier kept its whole path for as long as its newest blocks stayed
resident: bench/scale.py's soak grew from 768k nodes at hour 2 to 4.1M at hour
19 with 796k resident. The nodes left are the resident ones, the kept ones
and the branch points above them. A spliced key that is admitted again is
linked back in between its nearest indexed ancestor and descendant.

Invariants: ``slot`` and ``keys`` are inverse maps over live slots; ``total``
is the sum of ``copies`` over tiers; a node's ``parent`` is its nearest live
ancestor (so depths may skip: ``depth`` is the block's position in its
chain); ``nchild`` counts the live children and ``xchild`` is the XOR of
their slots (the one child, when there is one); every live node is resident,
kept, or has two children or more, as of the last ``prune`` over it;
``alias``, once built (``build_aliases``), maps a key's 64-bit alias to its
slot (of several live keys under one alias, one of them; pruning a key
drops only its own entry); a free slot has no copy and no child.

The alias map is built on first use, not kept from the start: only the
control channel's ``resolve`` (KVCR's ``kv.fetch``, asked of the engine
holding the blocks) reads it, and kept for every block it was 1.5 us of
a decode block's 9 us of admission at 256 x 64k (caches cold after vLLM's
step; per-section timers, 2026-12-06). Once built it is kept up to date.

Threading: not thread-safe; its one owner is the SessionPrefixIndex.

Memory: node state lives in ``array.array``s indexed by slot (a node's
fields are read and written one at a time on the hot paths, where an array
costs a third of a numpy scalar access: 24 against 74 ns a read here; the
bulk paths work on numpy views of them, ``view``); the only per-node Python
objects are the key bytes and its dict entries (key, and alias once built).
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Sequence
from itertools import compress
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from sessionkv.index.views import Resolved, alias64, aliases64
from sessionkv.types import TIERS, Tier

NONE = -1
MAX_COPIES = int(np.iinfo(np.uint16).max)
# Updates of at most this many keys run per key in Python, larger ones in
# numpy (the cheaper side of each, measured by bench/scale.py's steps).
FEW_KEYS = 16
_DTYPES = {"i": np.int32, "H": np.uint16, "I": np.uint32}


def view(a: array[int]) -> npt.NDArray[Any]:
    """A numpy view of one of the tree's arrays, no copy. Local only: an
    array exporting a view cannot grow (``BufferError``), so drop it first."""
    return np.frombuffer(a, _DTYPES[a.typecode])


class BlockTree:
    """Slots, tree links and copy counts of the index's nodes (see the module docstring).

    Its arrays are public to its owner, which reads them on hot paths; they
    grow in place. ``copies[tier]`` is one array per tier."""

    def __init__(self, initial_capacity: int = 1024):
        cap = max(16, initial_capacity)
        self.slot: dict[bytes, int] = {}
        self.alias: dict[int, int] | None = None  # alias64(key) -> slot, once built
        self._aliased = 0  # slots the build has covered
        self.keys: list[bytes | None] = []
        self._free: list[int] = []
        self.parent = array("i", [NONE]) * cap
        self.depth = array("i", bytes(4 * cap))
        self.nchild = array("i", bytes(4 * cap))
        self.xchild = array("i", bytes(4 * cap))  # XOR of the children's slots
        self.copies = [array("H", bytes(2 * cap)) for _ in TIERS]
        self.total = array("I", bytes(4 * cap))  # copies over all tiers

    def __len__(self) -> int:
        return len(self.slot)

    # ------------------------------------------------------------------ slots

    def reserve(self, nodes: int) -> None:
        """Capacity for ``nodes`` slots without growing."""
        self._grow(nodes)

    def _grow(self, need: int) -> None:
        cap = len(self.parent)
        if need <= cap:
            return
        more = max(need, cap * 2) - cap
        self.parent.extend(array("i", [NONE]) * more)
        for a in (self.depth, self.nchild, self.xchild, *self.copies, self.total):
            a.frombytes(bytes(a.itemsize * more))

    def _alloc(self, n: int) -> list[int]:
        reuse = self._free[-n:] if n else []
        del self._free[len(self._free) - len(reuse) :]
        fresh = n - len(reuse)
        start = len(self.keys)
        if fresh:
            self._grow(start + fresh)
            self.keys.extend([None] * fresh)
        return reuse[::-1] + list(range(start, start + fresh))

    def attach(
        self, chain: Sequence[bytes], slots: list[int | None], root: int = NONE, base: int = 0
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Make ``chain`` a path of the tree: ``chain[0]`` a child of ``root``
        (the tree's root by default) at depth ``base``, each key a child of
        the one before. ``slots`` holds ``chain``'s slots, None for the
        missing keys, and gets the new ones. Missing keys are linked in; a
        known key whose ancestors were spliced out gets them back above it
        (whether they were missing or came back as a leaf since). Returns
        the new slots linked in above a known key and, for each known key
        given a new parent, ``(slot, old parent)``: usually both empty."""
        n = len(chain)
        missing = slots.count(None)
        if missing == n:  # all new: a decode step's block
            self._link_run(chain, slots, 0, n, root, base)
            return [], []
        first_new = n - missing
        if slots[first_new:].count(None) == missing:  # a known prefix, then new keys
            bad = self._misparented(slots, first_new, root)
            if not bad:
                if missing:
                    self._link_run(chain, slots, first_new, n, root, base)
                return [], []
        else:
            bad = self._misparented(slots, n, root)
        return self._repair(chain, slots, bad, root, base)

    def add_leaf(self, key: bytes, parent: int, tier: Tier) -> int:
        """``attach`` of one new ``key`` below ``parent``, with one copy in
        ``tier``: a decode step's block, without the chain machinery. Its slot."""
        if self._free:
            s = self._free.pop()
        else:
            s = len(self.keys)
            if s == len(self.parent):
                self._grow(s + 1)
            self.keys.append(None)
        # A free slot has no copy and no child (``_drop``): only these are set.
        self.parent[s] = parent
        self.depth[s] = self.depth[parent] + 1
        self.copies[tier][s] = 1
        self.total[s] = 1
        self.nchild[parent] += 1
        self.xchild[parent] ^= s
        self.keys[s] = key
        self.slot[key] = s
        if self.alias is not None:
            self.alias[alias64(key)] = s
        return s

    def build_aliases(self, max_slots: int | None = None) -> bool:
        """Add the next ``max_slots`` slots (all when None) to the alias map,
        which from the first call on also gets every key admitted; whether
        every slot is covered (``alias`` complete)."""
        if self.alias is None:
            self.alias = {}
        lo, n = self._aliased, len(self.keys)
        hi = n if max_slots is None else min(n, lo + max_slots)
        live = [s for s in range(lo, hi) if self.keys[s] is not None]
        self.alias.update(zip(aliases64(cast("list[bytes]", [self.keys[s] for s in live])), live))
        self._aliased = hi
        return hi == n

    def _misparented(self, slots: list[int | None], m: int, root: int) -> list[int]:
        """The positions ``j < m`` whose node is not a child of the chain's
        previous one (``root`` for the first): a spliced link to repair. A
        known node after a missing one counts."""
        if m > FEW_KEYS and None not in slots[:m]:
            idx = np.array(slots[:m], np.int64)
            prevs = np.empty(m, np.int64)
            prevs[0] = root
            prevs[1:] = idx[:-1]
            found: list[int] = np.flatnonzero(view(self.parent)[idx] != prevs).tolist()
            return found
        parent = self.parent
        out: list[int] = []
        prev: int | None = root
        for j in range(m):
            s = slots[j]
            if s is not None and (prev is None or parent[s] != prev):
                out.append(j)
            prev = s
        return out

    def _repair(
        self, chain: Sequence[bytes], slots: list[int | None], bad: list[int], root: int, base: int
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """``attach`` off its common path: missing keys anywhere, spliced links."""
        n, parent, depth = len(chain), self.parent, self.depth
        for j in bad:  # validate before changing anything
            # ``bad`` names known keys only (``_misparented``), as is ``above``.
            known = cast(int, slots[j])
            above = cast(
                int, next((slots[i] for i in range(j - 1, -1, -1) if slots[i] is not None), root)
            )
            x = parent[known]
            if (
                depth[known] != base + j
                or x != NONE
                and (above == NONE or self.ancestor_at(above, depth[x]) != x)
            ):
                raise ValueError(
                    "chain holds a known key that is not the child of the "
                    "key before it, nor of a spliced-out one: not a prefix chain"
                )
        relinked: list[int] = []
        i = 0
        while i < n:  # link each run of missing keys
            if slots[i] is not None:
                i += 1
                continue
            j = i
            while j < n and slots[j] is None:
                j += 1
            self._link_run(chain, slots, i, j, root, base)
            if j < n:
                relinked.extend(cast("list[int]", slots[i:j]))
            i = j
        filled = cast("list[int]", slots)  # every missing key is linked now
        moved: list[tuple[int, int]] = []
        for j in bad:
            moved.append((filled[j], parent[filled[j]]))
            self._reparent(filled[j], filled[j - 1] if j else root)
        return relinked, moved

    def _link_run(
        self, chain: Sequence[bytes], slots: list[int | None], i: int, j: int, root: int, base: int
    ) -> None:
        """Link ``chain[i:j]`` (all missing) below ``slots[i - 1]`` (``root`` when i == 0)."""
        fresh = not self._free  # new slots are the list's end
        new = self._alloc(j - i)
        # ``slots[i - 1]`` is known or linked already: runs link left to right.
        parent = cast(int, slots[i - 1]) if i else root
        if len(new) <= FEW_KEYS:
            self._link_few(new, parent, base + i)
        else:
            self._link_many(new, parent, base + i)
        new_keys = chain[i:j]
        keys = self.keys
        if fresh:
            keys[new[0] : new[0] + len(new)] = new_keys
        else:
            for s, k in zip(new, new_keys):
                keys[s] = k
        self.slot.update(zip(new_keys, new))
        if self.alias is not None:
            self.alias.update(zip(aliases64(new_keys), new))
        slots[i:j] = new

    def _reparent(self, c: int, p: int) -> None:
        """Make ``p`` the parent of ``c`` in place of its spliced link."""
        old = self.parent[c]
        if old != NONE:
            self.nchild[old] -= 1
            self.xchild[old] ^= c
        self.parent[c] = p
        if p != NONE:
            self.nchild[p] += 1
            self.xchild[p] ^= c

    def _link_few(self, new: list[int], parent: int, depth: int) -> None:
        """The arrays of ``link`` per slot (numpy's per-call cost, FEW_KEYS)."""
        par, dep, nchild, xchild, copies, total = (
            self.parent,
            self.depth,
            self.nchild,
            self.xchild,
            self.copies,
            self.total,
        )
        for s in new:
            par[s] = parent
            dep[s] = depth
            nchild[s] = 0
            xchild[s] = 0
            for row in copies:
                row[s] = 0
            total[s] = 0
            if parent != NONE:
                nchild[parent] += 1
                xchild[parent] ^= s
            parent, depth = s, depth + 1

    def _link_many(self, new: list[int], parent: int, depth: int) -> None:
        idx = np.asarray(new, np.int64)
        view(self.parent)[idx] = [parent, *new[:-1]]
        view(self.depth)[idx] = np.arange(depth, depth + len(new), dtype=np.int32)
        nchild = view(self.nchild)
        nchild[idx] = 1
        nchild[new[-1]] = 0
        xchild = view(self.xchild)
        xchild[idx[:-1]] = idx[1:]
        xchild[new[-1]] = 0
        for row in self.copies:
            view(row)[idx] = 0
        view(self.total)[idx] = 0
        if parent != NONE:
            self.nchild[parent] += 1
            self.xchild[parent] ^= new[0]

    def prune(self, s: int, keep: Container[int]) -> None:
        """Remove ``s`` while it has no copy, no child and is not in ``keep``
        (the frontiers), then its ancestors the same way; the first of them
        left with no copy and one child, not kept, is spliced out."""
        nchild, xchild, total, parent = self.nchild, self.xchild, self.total, self.parent
        while s != NONE and total[s] == 0 and s not in keep:
            k, p = nchild[s], parent[s]
            if k > 1:
                return
            if k == 1:
                c = xchild[s]
                parent[c] = p
                if p != NONE:
                    xchild[p] ^= s ^ c
                nchild[s] = xchild[s] = 0
                self._drop(s)
                return
            self._drop(s)
            if p != NONE:
                nchild[p] -= 1
                xchild[p] ^= s
            s = p

    def _drop(self, s: int) -> None:
        """Free ``s``, which has no copy and no child left (``add_leaf`` relies on it)."""
        keys = cast("list[bytes]", self.keys)  # ``s`` is live: its key is set
        del self.slot[keys[s]]
        if self.alias is not None and self.alias.get(a := alias64(keys[s])) == s:
            del self.alias[a]
        self.keys[s] = None
        self.parent[s] = NONE
        self._free.append(s)

    # ---------------------------------------------------------------- copies

    def set_one(self, tier: Tier, slots: Sequence[int]) -> None:
        """At least one copy in ``tier`` for each of ``slots`` (a copy already
        counted is not counted twice)."""
        row, total = self.copies[tier], self.total
        if len(slots) <= FEW_KEYS:  # a decode step's block
            for s in slots:
                if row[s] == 0:
                    row[s] = 1
                    total[s] += 1
            return
        idx = np.asarray(slots, np.int64)
        rows = view(row)
        rows[idx] = np.maximum(rows[idx], 1)
        self._recount(idx)

    def put(self, tier: Tier, s: int, value: int) -> bool:
        """``value`` copies (0 to ``MAX_COPIES``) in ``tier`` for slot ``s``;
        whether it had a copy before and has none after. One slot, without
        the lists of ``set_each``: a decode step's G2 store or eviction."""
        row = self.copies[tier]
        old = row[s]
        if old == value:
            return False
        row[s] = value
        self.total[s] = left = self.total[s] + value - old
        return not left

    def set_each(self, tier: Tier, slots: Sequence[int], value: int) -> list[int]:
        """``value`` copies in ``tier`` for each of ``slots`` (clamped to
        ``[0, MAX_COPIES]``); the slots that had a copy before and have none
        after (sorted, once)."""
        if len(slots) > FEW_KEYS:
            return self.update(tier, [(s, value) for s in slots], absolute=True)
        if not 0 <= value <= MAX_COPIES:
            value = min(max(value, 0), MAX_COPIES)
        row, total = self.copies[tier], self.total
        gone = []  # a store's chunk, an evicted one
        for s in slots:
            old = row[s]
            if old != value:
                row[s] = value
                left = total[s] + value - old
                total[s] = left
                if not left:
                    gone.append(s)
        if len(gone) > 1:
            gone.sort()
        return gone

    def update(self, tier: Tier, pairs: list[tuple[int, int]], absolute: bool) -> list[int]:
        """Set (``absolute``) or add each ``(slot, value)``'s copies in
        ``tier``, per pair in order, clamped to ``[0, MAX_COPIES]`` after each;
        the slots that had a copy before and have none after (sorted, once)."""
        if len(pairs) <= FEW_KEYS:
            return self._update_few(tier, pairs, absolute)
        idx = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        vals = np.fromiter((v for _, v in pairs), np.int64, len(pairs))
        before = view(self.total)[idx] != 0
        if absolute:
            view(self.copies[tier])[idx] = np.clip(vals, 0, MAX_COPIES)
        else:
            # Sequential semantics, a key named twice counts twice; clamped at
            # zero after each step, as a per-key loop would.
            row = self.copies[tier]
            for s, v in pairs:
                row[s] = min(max(row[s] + v, 0), MAX_COPIES)
        self._recount(idx)
        gone = idx[before & (view(self.total)[idx] == 0)]
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
            old = row[s]
            new = min(max(v if absolute else old + v, 0), MAX_COPIES)
            row[s] = new
            total[s] = total[s] - old + new
        return sorted(s for s, had in before.items() if had and total[s] == 0)

    def _recount(self, idx: npt.NDArray[np.int64]) -> None:
        total = np.zeros(len(idx), np.uint32)
        for row in self.copies:
            total += view(row)[idx]
        view(self.total)[idx] = total

    def held(self, tier: Tier) -> list[bytes]:
        """The keys with a copy in ``tier``."""
        return [self.keys[s] for s in np.flatnonzero(view(self.copies[tier])).tolist()]

    def copies_of(self, key: bytes) -> dict[Tier, int] | None:
        s = self.slot.get(key)
        if s is None:
            return None
        return {t: self.copies[t][s] for t in TIERS}

    # ---------------------------------------------------------------- walks

    def ancestor_at(self, slot: int, depth: int) -> int:
        """The deepest ancestor-or-self of ``slot`` at ``depth`` or above
        (NONE when there is none): the node at ``depth`` when it is indexed."""
        parent, dep = self.parent, self.depth
        while slot != NONE and dep[slot] > depth:
            slot = parent[slot]
        return slot

    def nearest_resident_above(self, s: int) -> int:
        """The closest resident ancestor of ``s`` (NONE when there is none)."""
        parent, total = self.parent, self.total
        a = parent[s]
        while a != NONE and total[a] == 0:
            a = parent[a]
        return a

    def paths(self, tips: Iterable[int]) -> list[int]:
        """Every node on the paths from the root to ``tips``, once."""
        seen: set[int] = set()
        parent = self.parent
        for f in tips:
            s = f
            while s != NONE and s not in seen:
                seen.add(s)
                s = parent[s]
        return list(seen)

    def chain_to(self, key: bytes, n: int) -> list[bytes]:
        """``key`` and its indexed ancestors less than ``n`` blocks above it,
        root side first."""
        s = self.slot.get(key)
        if s is None:
            return []
        out: list[bytes] = []
        keys = cast("list[bytes]", self.keys)  # indexed nodes are live
        parent, depth, lo = self.parent, self.depth, self.depth[s] - n
        while s != NONE and depth[s] > lo:
            out.append(keys[s])
            s = parent[s]
        return out[::-1]

    def chunk_keys(self, keys: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
        """The known keys among ``keys`` whose depth + 1 is a multiple of
        ``blocks_per_chunk``: those that end a chunk."""
        if blocks_per_chunk == 1:
            return [k for k in keys if k in self.slot]
        depth = self.depth
        return [
            k
            for k in keys
            if (s := self.slot.get(k)) is not None and (depth[s] + 1) % blocks_per_chunk == 0
        ]

    def result(self, slots: Iterable[int]) -> Resolved:
        """The resident ones of ``slots`` as a ``Resolved`` (root side first,
        ties by key). Filter, order and per-tier split run in numpy (a free
        slot has no copy, so ``total`` alone says resident); only runs of
        equal depth (branches) are sorted by key in Python: a hint's
        resolution runs in one hold of the lock."""
        keys_of = cast("list[bytes]", self.keys)  # resident slots are live
        idx = np.fromiter(slots, dtype=np.int64)
        idx = idx[view(self.total)[idx] != 0]
        dep = view(self.depth)[idx]
        order = np.argsort(dep, kind="stable")
        idx, dep = idx[order], dep[order]
        ordered: list[int] = idx.tolist()
        ties = np.flatnonzero(dep[1:] == dep[:-1])
        if ties.size:  # equal depths: by key, as before
            bounds = np.flatnonzero(np.diff(dep) != 0) + 1
            for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), len(ordered)]):
                if b - a > 1:
                    ordered[a:b] = sorted(ordered[a:b], key=keys_of.__getitem__)
            idx = np.asarray(ordered, dtype=np.int64)
        keys = [keys_of[s] for s in ordered]
        per_tier = {
            t: list(compress(keys, (view(self.copies[t])[idx] > 0).tolist())) for t in TIERS
        }
        return Resolved(keys, per_tier)
