"""Brute-force reference model of SessionPrefixIndex semantics (tests only).

Plain dicts and whole-structure recomputation: slow and obviously right.
"""

from collections import OrderedDict

TIERS = (0, 1, 2)


class RefIndex:
    def __init__(self, idle_timeout_s=None, max_tombstones=10_000):
        self.parent = {}  # key -> parent key | None
        self.depth = {}  # key -> its position in its chain
        self.copies = {}  # key -> [g1, g2, g3]
        self.sessions = {}  # session -> set of frontier keys
        self.last = {}
        self.tombstones = OrderedDict()
        self.idle = idle_timeout_s
        self.max_tombstones = max_tombstones

    # helpers
    def resident(self, k):
        return any(self.copies[k])

    def ancestors(self, k):
        """k and its ancestors."""
        out = []
        while k is not None:
            out.append(k)
            k = self.parent[k]
        return out

    def maximal(self, keys):
        """Keys none of the others descends from (the antichain of tips)."""
        keys = set(keys)
        return {k for k in keys if not any(k != o and k in self.ancestors(o) for o in keys)}

    def prune(self):
        """Remove each node with no copy that is no frontier and has no
        child; splice out each such node with one child (its child's parent
        becomes its own); until nothing changes."""
        while True:
            children = {}
            for k, p in self.parent.items():
                if p is not None:
                    children.setdefault(p, []).append(k)
            fronts = set().union(*self.sessions.values()) if self.sessions else set()
            idle = [
                k
                for k in self.parent
                if not self.resident(k) and k not in fronts and len(children.get(k, ())) <= 1
            ]
            if not idle:
                return
            k = idle[0]
            for c in children.get(k, ()):
                self.parent[c] = self.parent[k]
            del self.parent[k], self.copies[k], self.depth[k]

    # mutation
    def admit(self, session, chain, tier=None, start=0, now=0.0, above=None):
        """``chain[0]`` a child of ``above`` (the root when None)."""
        if not chain:
            return
        base = 0 if above is None else self.depth[above] + 1
        for i, k in enumerate(chain):  # spliced-out keys come back between their kin
            self.parent[k] = chain[i - 1] if i else above
            self.depth[k] = base + i
            self.copies.setdefault(k, [0, 0, 0])
        if tier is not None:
            for k in chain[start:]:
                self.copies[k][tier] = max(self.copies[k][tier], 1)
        resident = [k for k in chain if self.resident(k)]
        if session is not None:
            if session not in self.sessions:
                self.sessions[session] = set()
                self.tombstones.pop(session, None)
            # re-inserted: ``last`` is in access order, the order idle sessions end in
            self.last[session] = max(self.last.pop(session, 0.0), now)
            if resident:
                t = resident[-1]
                self.sessions[session] = self.maximal(self.sessions[session] | {t})
        self.prune()

    def extend(self, session, parent, keys, tier, now=0.0):
        """Only the links it is told: ``keys`` below ``parent``."""
        if parent not in self.parent:
            return False
        self.admit(session, keys, tier, 0, now, above=parent)
        return True

    def update(self, tier, keys, values, absolute):
        if isinstance(values, int):
            values = [values] * len(keys)
        before = {k: self.resident(k) for k in keys if k in self.parent}
        for k, v in zip(keys, values):
            if k in self.parent:
                c = v if absolute else self.copies[k][tier] + v
                self.copies[k][tier] = min(max(c, 0), 65535)
        gone = {k for k, was in before.items() if was and not self.resident(k)}
        for s, fronts in self.sessions.items():
            targets = set()
            for f in fronts & gone:
                anc = [a for a in self.ancestors(f)[1:] if self.resident(a)]
                if anc:
                    targets.add(anc[0])
            self.sessions[s] = self.maximal((fronts - gone) | targets)
        self.prune()

    def end_session(self, session, now=0.0):
        if session not in self.sessions:
            return False
        del self.sessions[session]
        del self.last[session]
        self.tombstones[session] = now
        self.tombstones.move_to_end(session)
        while len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)
        self.prune()
        return True

    def expire(self, now):
        if self.idle is None:
            return []
        idle = [s for s in self.last if self.last[s] < now - self.idle]
        for s in idle:
            self.end_session(s, now)
        return idle

    # queries
    def members(self, fronts):
        out = set()
        for f in fronts:
            out.update(self.ancestors(f))
        return out

    def result(self, keys):
        keys = sorted(
            (k for k in keys if k in self.parent and self.resident(k)),
            key=lambda k: (self.depth[k], k),
        )
        return keys, {t: [k for k in keys if self.copies[k][t] > 0] for t in TIERS}

    def resolve_session(self, session, branch=None, boundary=None):
        if session not in self.sessions:
            return None
        fronts = self.sessions[session]
        if branch is not None:
            if branch not in fronts:
                return None
            return self.result(self.ancestors(branch))
        if boundary is not None:
            if boundary not in self.members(fronts):
                return None
            return self.result(self.ancestors(boundary))
        return self.result(self.members(fronts))

    def sessions_of(self, key):
        if key not in self.parent:
            return []
        return sorted(s for s, f in self.sessions.items() if key in self.members(f))
