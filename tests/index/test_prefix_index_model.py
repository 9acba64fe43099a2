"""SessionPrefixIndex against the brute-force reference model: random
admissions, hits, forks, copy changes in every tier, G1 evictions seen only
through the probe, session ends and idle expiry; every query must agree."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from reference import RefIndex

from sessionkv.devtools.keys import block_key
from sessionkv.index import tree
from sessionkv.index.prefix_index import SessionPrefixIndex, alias64
from sessionkv.types import Tier

SESSIONS = ["s0", "s1", "s2", "s3"]
TIER = st.sampled_from(list(Tier))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = {}  # G1 truth: key -> copies (vLLM's block pool)
        self.idx = SessionPrefixIndex(
            g1_probe=lambda keys: [self.pool.get(k, 0) for k in keys],
            idle_timeout_s=50.0,
            max_tombstones=2,
        )
        self.ref = RefIndex(idle_timeout_s=50.0, max_tombstones=2)
        self.chains = [[]]  # every chain seen; [] is the root
        self.counter = 0
        self.now = 0.0

    def fresh(self):
        self.counter += 1
        # 32-byte hash + 4-byte group, as vLLM's OffloadKey
        return block_key(self.counter)

    def all_keys(self):
        return sorted({k for c in self.chains for k in c})

    def sync_g1(self):
        """Both sides see the same G1 truth: the model directly, the index
        through its probe (sweep)."""
        keys = [k for k in self.ref.parent if self.ref.copies[k][0] != self.pool.get(k, 0)]
        self.ref.update(0, keys, [self.pool.get(k, 0) for k in keys], absolute=True)
        self.idx.sweep_g1()

    @rule(base=st.integers(0, 10**6), cut=st.integers(0, 12), extra=st.integers(0, 5))
    def new_chain(self, base, cut, extra):
        """A new prompt: a prefix of a known chain (a fork), then new blocks."""
        parent = self.chains[base % len(self.chains)]
        chain = parent[: min(cut, len(parent))] + [self.fresh() for _ in range(extra)]
        if chain:
            self.chains.append(chain)

    @rule(
        c=st.integers(0, 10**6),
        s=st.sampled_from(SESSIONS + [None]),
        cut=st.integers(1, 20),
        tier=st.none() | TIER,
        start=st.integers(0, 20),
        dt=st.floats(0, 20),
    )
    def admit(self, c, s, cut, tier, start, dt):
        chain = self.chains[c % len(self.chains)][:cut]
        self.now += dt
        if tier == Tier.G1:
            for k in chain[start:]:
                self.pool[k] = max(self.pool.get(k, 0), 1)
        self.idx.admit(s, chain, tier, start, self.now)
        self.ref.admit(s, chain, None if tier is None else int(tier), start, self.now)

    @rule(
        c=st.integers(0, 10**6),
        s=st.sampled_from(SESSIONS + [None]),
        cut=st.integers(2, 20),
        tier=TIER,
        start=st.integers(1, 19),
        dt=st.floats(0, 20),
    )
    def extend(self, c, s, cut, tier, start, dt):
        """A step's admission (``extend``): the blocks after ``start`` below
        the chain's block ``start - 1``; the whole chain when that one is gone.
        ``extend`` sees no link above its parent: a spliced link up there
        stays until an ``admit`` of the chain repairs it."""
        chain = self.chains[c % len(self.chains)][:cut]
        if not 1 <= start < len(chain):
            return
        self.now += dt
        if tier == Tier.G1:
            for k in chain[start:]:
                self.pool[k] = max(self.pool.get(k, 0), 1)
        extended = self.idx.extend(s, chain[start - 1], chain[start:], tier, self.now)
        assert extended == self.ref.extend(s, chain[start - 1], chain[start:], int(tier), self.now)
        if not extended:
            self.idx.admit(s, chain, tier, start, self.now)
            self.ref.admit(s, chain, int(tier), start, self.now)

    @rule(
        tier=TIER,
        picks=st.lists(st.integers(0, 10**6), max_size=6),
        count=st.integers(0, 2),
        absolute=st.booleans(),
        delta=st.integers(-2, 2),
    )
    def copies(self, tier, picks, count, absolute, delta):
        keys = self.all_keys()
        if not keys:
            return
        chosen = [keys[p % len(keys)] for p in picks]
        if tier == Tier.G1:
            # G1 changes happen in vLLM's pool, unseen until probed: evictions,
            # and duplicate copies of blocks already there. New blocks enter
            # through admit.
            for k in chosen:
                if self.pool.get(k, 0) > 0:
                    self.pool[k] = count if absolute else max(0, self.pool[k] + delta)
            return
        if absolute:
            self.idx.set_copies(tier, chosen, count)
            self.ref.update(int(tier), chosen, count, absolute=True)
        else:
            self.idx.add_copies(tier, chosen, delta)
            self.ref.update(int(tier), chosen, delta, absolute=False)

    @rule(s=st.sampled_from(SESSIONS))
    def end(self, s):
        self.sync_g1()
        assert self.idx.end_session(s, self.now) == self.ref.end_session(s, self.now)

    @rule(dt=st.floats(0, 60))
    def expire(self, dt):
        self.sync_g1()
        self.now += dt
        assert sorted(self.idx.expire(self.now)) == sorted(self.ref.expire(self.now))

    @invariant()
    def agree(self):
        self.sync_g1()
        idx, ref = self.idx, self.ref
        assert set(k for k in ref.parent) == set(k for c in self.chains for k in c if k in idx)
        assert len(idx) == len(ref.parent)
        for k in ref.parent:
            assert idx.copies(k) == dict(zip(Tier, ref.copies[k]))
        assert sorted(idx.sessions()) == sorted(ref.sessions)
        for s in SESSIONS:
            assert idx.is_ended(s) == (s in ref.tombstones)
            fronts = idx.frontiers(s)
            assert (fronts is None) == (s not in ref.sessions)
            if fronts is None:
                continue
            assert fronts == sorted(ref.sessions[s])
            self.same(idx.resolve_session(s), ref.resolve_session(s))
            for f in fronts:
                self.same(idx.resolve_session(s, branch=f), ref.resolve_session(s, branch=f))
            for k in self.all_keys()[:8]:
                self.same(idx.resolve_session(s, boundary=k), ref.resolve_session(s, boundary=k))
            summ = idx.summary(s)
            keys, per_tier = ref.resolve_session(s)
            assert summ.blocks == len(keys)
            assert summ.per_tier == {t: len(per_tier[int(t)]) for t in Tier}
            assert summ.last_access == ref.last[s]
        for k in self.all_keys():
            assert idx.sessions_of(k) == ref.sessions_of(k)
        keys = self.all_keys()
        self.same(idx.resolve_keys(keys), ref.result(keys))
        self.same(idx.resolve_aliases([alias64(k) for k in keys]), ref.result(keys))

    @staticmethod
    def same(got, want):
        if want is None:
            assert got is None
            return
        keys, per_tier = want
        assert got.keys == keys
        assert got.per_tier == {t: per_tier[int(t)] for t in Tier}


IndexMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestIndexAgainstReference = IndexMachine.TestCase


class IndexMachineNumpyUpdates(IndexMachine):
    """The same machine with every copy update on the numpy path (the rules
    update at most six keys, which the per-key path takes otherwise)."""

    def __init__(self):
        super().__init__()
        self._few, tree.FEW_KEYS = tree.FEW_KEYS, 0

    def teardown(self):
        tree.FEW_KEYS = self._few


IndexMachineNumpyUpdates.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
TestIndexAgainstReferenceNumpyUpdates = IndexMachineNumpyUpdates.TestCase
