"""The router's shadow caches keep G2's blocks in vLLM 0.33's LRU order
(``sessionkv.router.shadow``): a running turn's blocks rank by its start and
their positions, a turn's end makes them the most recent. Checked against a
model that sorts, and, where the running vLLM ranks by position (the 0.33
pass: ``scripts/test --vllm 0.33 tests/router/test_shadow_order.py``),
against vLLM's own CPU manager and LRU policy."""

import hypothesis.strategies as st
from hypothesis import given, settings
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from sessionkv.router.shadow import ShadowCache

BY_POSITION = hasattr(CachePolicy, "on_request_access")  # vLLM 0.33's LRU


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 2 + b"\0" * 4


def chain(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def test_a_running_turn_keeps_its_blocks_before_idle_ones_and_loses_its_tail_first():
    sh = ShadowCache(6)
    sh.request(chain(1, 2, 3))  # p: served and ended
    sh.request(chain(11, 12, 13))  # x: idle, newer than p
    sh.request(chain(1, 2, 3, 4, 5), turn="b")  # b reads p and stores 4, 5
    assert [k in sh for k in chain(13, 12, 11)] == [False, False, True]  # x's tail first
    sh.request(chain(21), turn="y")  # y begins and ends while b runs
    sh.finish("y")
    assert chain(11)[0] not in sh and all(k in sh for k in chain(1, 2, 3, 4, 5, 21))
    sh.request(chain(31))  # b goes before y, its tail first
    assert chain(5)[0] not in sh and all(k in sh for k in chain(1, 2, 3, 4, 21, 31))
    sh.finish("b")  # b's blocks the most recent, head last
    sh.request(chain(41))
    sh.request(chain(51))
    assert [k in sh for k in chain(21, 31, 4, 3, 2, 1)] == [False, False, True, True, True, True]


def test_a_turn_named_again_ends_the_one_before():
    sh = ShadowCache(3)
    sh.request(chain(1), turn="s")
    sh.request(chain(2))  # ended at once: newer than s's 1
    sh.request(chain(3), turn="s")  # s's first turn ends: 1 newer than 2
    sh.request(chain(4))  # so 2 goes, not 1
    assert [k in sh for k in chain(1, 2, 3, 4)] == [True, False, True, True]
    sh.finish("s")
    sh.finish("s")  # nothing running by that name
    assert len(sh) == 3


def test_running_turns_hold_at_most_max_blocks():
    sh = ShadowCache(8, max_blocks=20)
    for t in range(100):
        sh.request(chain(2 * t, 2 * t + 1), turn=f"t{t}")
    assert len(sh._open) == 10 and sh._open_blocks == 20
    sh.finish("t89")  # forgotten: its blocks keep their rank
    assert len(sh._open) == 10


class LRUModel:
    """vLLM 0.33's LRU at the granularity of turns, as a sort: a turn draws a
    rank at its start; its blocks rank (rank, -position), rising only; its
    end gives them new ranks, head last; room is made by evicting the least
    ranked blocks that are not the request's own."""

    def __init__(self, capacity):
        self.capacity, self.rank, self.next, self.open = capacity, {}, 0, {}

    def request(self, keys, turn):
        if turn in self.open:
            self.finish(turn)
        self.next += 1
        r = self.next
        for pos, k in enumerate(keys, 1):
            if k not in self.rank or self.rank[k] < (r, -pos):
                self.rank[k] = (r, -pos)
        free = sorted((k for k in self.rank if k not in set(keys)), key=lambda k: (self.rank[k], k))
        for k in free[: max(0, len(self.rank) - self.capacity)]:
            del self.rank[k]
        self.open[turn] = keys

    def finish(self, turn):
        for k in reversed(self.open.pop(turn, [])):
            if k in self.rank:
                self.next += 1
                self.rank[k] = (self.next, 0)


class VLLMEngine:
    """vLLM's CPU manager with its LRU policy, called per turn as vLLM's
    offloading connector calls it (no G1: every block is looked up)."""

    def __init__(self, capacity):
        self.mgr = CPUOffloadingManager(num_chunks=capacity, cache_policy="lru")
        self.open = {}

    def request(self, keys, turn):
        if turn in self.open:
            self.finish(turn)
        ctx = self.open[turn] = ReqContext(req_id=turn)
        for pos, k in enumerate(keys, 1):
            ctx.set_offload_key_position(k, 16 * pos)
        self.mgr.on_new_request(ctx)
        b = 0
        while b < len(keys) and self.mgr.lookup(keys[b], ctx) is LookupResult.HIT:
            b += 1
        if b:
            self.mgr.prepare_load(keys[:b], ctx)
            self.mgr.complete_load(keys[:b], ctx)
        offered = keys[b:] if b else keys
        out = self.mgr.prepare_store(offered, ctx)
        self.mgr.complete_store(out.keys_to_store, ctx)

    def finish(self, turn):
        ctx = self.open.pop(turn, None)
        if ctx is not None:
            self.mgr.on_request_finished(ctx)

    def resident(self, keys):
        return {
            k for k in keys if self.mgr.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT
        }


# chains of a few shared prefixes, so that turns read what others stored
PREFIX = st.sampled_from([(), (1,), (1, 2), (3, 4, 5)])
turns = st.lists(
    st.one_of(
        st.tuples(
            st.just("start"), st.integers(0, 3), PREFIX, st.integers(0, 40), st.integers(0, 3)
        ),
        st.tuples(st.just("end"), st.integers(0, 3)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(turns)
def test_the_shadow_keeps_the_blocks_vllms_lru_keeps(script):
    capacity = 10
    sh, model = ShadowCache(capacity), LRUModel(capacity)
    engine = VLLMEngine(capacity) if BY_POSITION else None
    seen = set()
    for op in script:
        turn = f"t{op[1]}"
        if op[0] == "start":
            _, _, prefix, tail, extra = op
            keys = chain(*prefix, *range(100 + 10 * tail, 100 + 10 * tail + extra))
            seen.update(keys)
            sh.request(keys, turn=turn)
            model.request(keys, turn)
            if engine is not None:
                engine.request(keys, turn)
        else:
            sh.finish(turn)
            model.finish(turn)
            if engine is not None:
                engine.finish(turn)
        assert {k for k in seen if k in sh} == set(model.rank)
        if engine is not None:
            assert engine.resident(seen) == set(model.rank)


def test_the_hint_policy_ends_a_turn_in_its_shadows_when_the_turn_or_session_ends():
    from sessionkv.router.config import HintPolicy
    from sessionkv.router.retains import SessionHints

    p = SessionHints(HintPolicy(strategy="auto"), lambda: 1000.0)
    p.add_engine("a", 1024, 256, 100.0)
    shadows = p._engines["a"].shadows.values()
    p.turn_started("s1", "a", chain(1, 2))
    p.turn_started("s2", "a", chain(3))
    assert all(set(sh._open) == {"s1", "s2"} for sh in shadows)
    p.turn_ended("s1")
    p.session_ended("s2")
    assert all(not sh._open for sh in shadows)
