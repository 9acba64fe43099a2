"""SessionPrefixIndex on the RFC's own examples, one behaviour per test."""

import pytest

from sessionkv.devtools.cost import lines_run
from sessionkv.devtools.keys import block_key
from sessionkv.index.prefix_index import SessionPrefixIndex, alias64
from sessionkv.types import Tier

A, AB, ABC, AD, AE = (
    block_key("A"),
    block_key("AB"),
    block_key("ABC"),
    block_key("AD"),
    block_key("AE"),
)


def test_shared_prefix_stored_once_and_branches_are_frontiers():
    idx = SessionPrefixIndex()
    idx.admit("s1", [A, AB, ABC], Tier.G1)
    idx.admit("s2", [A, AD], Tier.G1, start=1)
    idx.admit("s5", [A, AB, ABC], None)  # a pure cache hit makes s5 a member
    idx.admit("s5", [A, AD], None)  # ...of two concurrent branches
    assert len(idx) == 4
    assert idx.frontiers("s5") == sorted([ABC, AD])
    assert idx.sessions_of(A) == ["s1", "s2", "s5"]
    assert idx.sessions_of(AB) == ["s1", "s5"]
    assert idx.resolve_session("s2").keys == [A, AD]


def test_extending_a_branch_moves_its_frontier():
    idx = SessionPrefixIndex()
    idx.admit("s", [A], Tier.G1)
    idx.admit("s", [A, AB], Tier.G1, start=1)
    idx.admit("s", [A, AB, ABC], Tier.G1, start=2)
    assert idx.frontiers("s") == [ABC]
    idx.admit("s", [A, AB], None)  # a hit on its own prefix changes nothing
    assert idx.frontiers("s") == [ABC]


def test_one_copy_gone_keeps_the_extent_while_another_remains():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB], Tier.G1)
    idx.set_copies(Tier.G2, [A, AB], 1)
    idx.set_copies(Tier.G1, [A, AB], 0)  # G1 evicted, G2 still holds both
    assert idx.frontiers("s") == [AB]
    assert idx.resolve_session("s").per_tier[Tier.G2] == [A, AB]
    assert idx.resolve_session("s").per_tier[Tier.G1] == []


def test_last_copy_gone_frontier_retreats_then_branch_is_removed():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB, ABC], Tier.G2)
    idx.set_copies(Tier.G2, [ABC], 0)
    assert idx.frontiers("s") == [AB] and ABC not in idx
    idx.set_copies(Tier.G2, [A, AB], 0)
    assert idx.frontiers("s") == [] and len(idx) == 0


def test_a_node_with_no_copy_and_one_child_is_spliced_out_and_comes_back():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB, ABC], Tier.G2)
    idx.set_copies(Tier.G2, [AB], 0)  # a middle chunk evicted: spliced out
    assert AB not in idx and len(idx) == 2 and idx.frontiers("s") == [ABC]
    assert idx.resolve_session("s").keys == [A, ABC]
    assert idx.chain_to(ABC, 2) == [ABC]  # its chunk's blocks: AB is not indexed
    idx.admit("s", [A, AB, ABC], Tier.G1, start=1)  # recomputed: linked back in
    assert idx.resolve_session("s").keys == [A, AB, ABC] and idx.chain_to(ABC, 2) == [AB, ABC]
    idx.set_copies(Tier.G1, [AB, ABC], 0)
    idx.set_copies(Tier.G2, [AB], 0)  # AB has no copy again
    assert AB not in idx
    idx.admit(None, [A, AB, ABC], None)  # a hit links it back, with no copy: out again
    assert AB not in idx and idx.resolve_session("s").keys == [A, ABC]
    idx.set_copies(Tier.G2, [ABC], 0)
    assert len(idx) == 1 and idx.frontiers("s") == [A]


def test_a_long_session_keeps_what_is_resident_not_its_history():
    # Issue "production scale": bench/scale.py's soak kept each session's
    # whole path while its newest blocks were resident (768k nodes at hour 2,
    # 4.1M at hour 19, 796k resident).
    idx = SessionPrefixIndex()
    chain = [block_key(f"h{i}") for i in range(1000)]
    idx.admit("s", chain[:32], Tier.G2)
    for turn in range(1, 1000 // 32):
        new = chain[32 * turn : 32 * turn + 32]
        assert idx.extend("s", chain[32 * turn - 1], new, Tier.G2)
        idx.set_copies(Tier.G2, chain[32 * (turn - 1) : 32 * turn], 0)  # the older turn evicted
    assert len(idx) == 32 and idx.resolve_session("s").keys == chain[32 * 30 : 32 * 31]
    with pytest.raises(ValueError, match="prefix chain"):  # not the spliced key's kin
        idx.admit(None, [block_key("X"), block_key("Y"), chain[32 * 30]], Tier.G1)


def test_selectors_branch_boundary_and_exact_keys():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB, ABC], Tier.G1)
    idx.admit("s", [A, AE], Tier.G2, start=1)
    assert idx.resolve_session("s", branch=AE).keys == [A, AE]
    assert idx.resolve_session("s", branch=AB) is None  # not a branch tip
    assert idx.resolve_session("s", boundary=AB).keys == [A, AB]
    assert idx.resolve_session("s", boundary=AD) is None  # not in the session
    got = idx.resolve_keys([ABC, AE, AD])
    assert got.keys == [AE, ABC] and got.per_tier[Tier.G2] == [AE]
    assert idx.resolve_session("nobody") is None


def test_deepest_branch_is_the_current_chain():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB, ABC], Tier.G1)
    idx.admit("s", [A, AE], Tier.G1, start=1)  # a shorter branch
    assert idx.deepest_branch("s") == ABC
    idx.set_copies(Tier.G1, [ABC], 0)  # retreats to AB: a tie, by key
    assert idx.deepest_branch("s") == max(AB, AE)
    assert idx.deepest_branch("nobody") is None


def test_g1_evictions_are_seen_lazily_through_the_probe():
    pool = {}
    idx = SessionPrefixIndex(g1_probe=lambda keys: [pool.get(k, 0) for k in keys])
    pool.update({A: 1, AB: 1})
    idx.admit("s", [A, AB], Tier.G1)
    del pool[AB]  # vLLM evicted it; no callback
    assert idx.copies(AB) == {Tier.G1: 1, Tier.G2: 0, Tier.G3: 0}
    assert idx.frontiers("s") == [A]  # the query re-read the pool
    assert AB not in idx


def test_sweep_prunes_what_g1_dropped_round_robin():
    pool = {}
    idx = SessionPrefixIndex(g1_probe=lambda keys: [pool.get(k, 0) for k in keys])
    chain = [block_key(f"k{i}") for i in range(10)]
    pool.update(dict.fromkeys(chain, 1))
    idx.admit(None, chain, Tier.G1)
    pool.clear()
    assert idx.sweep_g1(max_slots=4) == 4
    assert len(idx) == 6  # 4 with no copy and one child: spliced
    while len(idx):
        idx.sweep_g1(max_slots=4)
    assert len(idx) == 0


def test_session_end_idle_expiry_and_bounded_tombstones():
    idx = SessionPrefixIndex(idle_timeout_s=10, max_tombstones=2)
    for i, s in enumerate(["a", "b", "c"]):
        idx.admit(s, [A], Tier.G2, now=float(i))
    assert idx.end_session("a", now=5) and not idx.end_session("a", now=5)
    assert idx.expire(now=11.5) == ["b"]  # idle since 1.0; c was seen at 2.0
    assert idx.is_ended("a") and idx.is_ended("b")
    idx.end_session("c", now=12)
    assert not idx.is_ended("a")  # oldest tombstone dropped
    assert A in idx  # blocks outlive sessions while resident
    idx.admit("a", [A], None, now=13)  # a new request reopens a session
    assert idx.has_session("a") and idx.frontiers("a") == [A]


def test_summary_and_alias():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB], Tier.G1, now=3.0)
    idx.set_copies(Tier.G3, [A], 2)
    summ = idx.summary("s")
    assert (summ.blocks, summ.per_tier, summ.last_access) == (
        2,
        {Tier.G1: 2, Tier.G2: 0, Tier.G3: 1},
        3.0,
    )
    assert alias64(AB) == int.from_bytes(AB[-12:-4], "big")


def test_the_alias_map_is_built_on_first_use_and_kept_from_then_on():
    # Admission keeps no alias map until something resolves an alias (the
    # control channel's ``resolve``); a build in slices, with admissions and
    # prunes between, ends with exactly the live keys' aliases.
    idx = SessionPrefixIndex()
    chains = [[block_key(f"{c}{i}") for i in range(j + 1)] for c in "PQRS" for j in range(6)]
    for c in "PQRS":
        chain = [block_key(f"{c}{i}") for i in range(6)]
        idx.admit(c, chain[:4], Tier.G1)
        idx.extend(c, chain[3], chain[4:5], Tier.G1, now=1.0)  # a decode step's leaf
    assert idx._tree.alias is None
    assert not idx.build_aliases(3)
    idx.set_copies(Tier.G1, [block_key(f"P{i}") for i in range(5)], 0)  # P pruned
    for c in "QRS":  # leaves and a chain after the build began
        chain = [block_key(f"{c}{i}") for i in range(8)]
        idx.extend(c, chain[4], chain[5:6], Tier.G1, now=2.0)
        idx.admit(c, chain, Tier.G1, start=6, now=3.0)
    while not idx.build_aliases(3):
        pass
    live = [k for k in dict.fromkeys(k for ch in chains for k in ch) if k in idx]
    live += [block_key(f"{c}{i}") for c in "QRS" for i in (6, 7)]
    assert block_key("P0") not in idx and block_key("Q7") in idx
    assert idx._tree.alias == {alias64(k): idx._tree.slot[k] for k in live}
    assert idx.resolve_aliases([alias64(k) for k in live]).keys == idx.resolve_keys(live).keys
    assert idx.resolve_aliases([alias64(block_key("P0"))]).keys == []


def test_a_chain_that_is_not_a_prefix_chain_is_refused():
    idx = SessionPrefixIndex()
    idx.admit(None, [A, AB], Tier.G1)
    with pytest.raises(ValueError, match="prefix chain"):
        idx.admit(None, [block_key("X"), AB], Tier.G1)


def test_chain_to_and_clear_tier():
    idx = SessionPrefixIndex()
    idx.admit("s", [A, AB, ABC], Tier.G2)
    assert idx.chain_to(ABC, 2) == [AB, ABC]
    assert idx.chain_to(AB, 5) == [A, AB]
    assert idx.chain_to(AD, 2) == []
    idx.clear_tier(Tier.G2)
    assert len(idx) == 0 and idx.frontiers("s") == []


def test_sessions_in_access_order_and_expiry_costs_what_it_ends():
    # Issue "production scale": expiry and the status op passed over every
    # session; with sessions kept in access order they cost what they return.
    def build(n):
        idx = SessionPrefixIndex(idle_timeout_s=10)
        idx.admit("old", [A], Tier.G2, now=0.0)
        for i in range(n):
            idx.admit(f"s{i}", [block_key(f"x{i}")], Tier.G2, now=100.0 + i)
        return idx

    costs = []
    for n in (10, 2000):
        idx, got = build(n), []
        costs.append(
            (
                lines_run(lambda: got.append(idx.expire(now=50.0)), ("prefix_index.py",)),
                lines_run(lambda: got.append(idx.recent_sessions(3)), ("prefix_index.py",)),
            )
        )
        assert got == [["old"], [f"s{n - 1}", f"s{n - 2}", f"s{n - 3}"]]
        idx.admit("s0", [block_key("x0")], None, now=1.0)  # a late clock: dated the newest
        assert idx.recent_sessions(1) == ["s0"] and idx.summary("s0").last_access == 100.0 + n - 1
    assert costs[0] == costs[1], costs


class _CountingDict(dict):
    """The index's key -> slot map, counting lookups."""

    lookups = 0

    def get(self, k, default=None):
        _CountingDict.lookups += 1
        return super().get(k, default)


def test_a_steps_admission_looks_up_only_the_blocks_it_adds():
    # Issue "production scale": admission looked up the request's whole chain
    # on every step that filled a block (0.28 ms per admit of 4,096 blocks).
    idx = SessionPrefixIndex()
    chain = [block_key(f"c{i}") for i in range(4097)]
    idx.admit("s", chain[:4096], Tier.G1, now=1.0)
    idx._tree.slot = _CountingDict(idx._tree.slot)
    assert idx.extend("s", chain[4095], chain[4096:], Tier.G1, now=2.0)
    assert _CountingDict.lookups <= 2
    assert idx.frontiers("s") == [chain[4096]] and len(idx) == 4097
    assert idx.resolve_session("s").keys == chain
    assert not idx.extend("s", block_key("never-seen"), [block_key("x")], Tier.G1)


def test_one_key_counts_clamp_as_many_keys_do():
    # set_copies of one key takes its own path (a decode step's G2 store or
    # eviction); counts out of range clamp on both paths alike.
    from sessionkv.index.tree import MAX_COPIES

    one, many = SessionPrefixIndex(), SessionPrefixIndex()
    for idx in (one, many):
        idx.admit("s", [A, AB], Tier.G2)
    one.set_copies(Tier.G3, [AB], MAX_COPIES + 5)
    many.set_copies(Tier.G3, [AB, block_key("unknown")], MAX_COPIES + 5)
    assert one.copies(AB) == many.copies(AB) and one.copies(AB)[Tier.G3] == MAX_COPIES
    one.set_copies(Tier.G2, [AB], -3)
    many.set_copies(Tier.G2, [AB, block_key("unknown")], -3)
    assert one.copies(AB) == many.copies(AB) and one.copies(AB)[Tier.G2] == 0
    for idx in (one, many):
        idx.set_copies(Tier.G3, [AB], 0)
    assert AB not in one and AB not in many  # no copy left: pruned on both
