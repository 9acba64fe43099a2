"""The SessionPrefixIndex inside real vLLM agrees with what vLLM and the tiers hold.

Two sessions share a system prompt; one forks into two branches; a third
session only hits cached blocks (membership without storing). After the runs,
after G1 is dropped, and after G2 is flooded, the index's frontiers, members and
per-tier residency are compared with the truth read from vLLM's block pool (G1)
and from the primary tier (G2).
"""

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from sessionkv.devtools.engines import kv_transfer_config, new_engine_id, tiny_llm
from sessionkv.devtools.keys import keys_of
from sessionkv.devtools.server import remove_offload_region
from sessionkv.types import Tier

BLOCK = 32
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4  # layers * K,V * heads * head_dim * tokens * fp32
G2_CHUNKS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=4)
RNG = np.random.default_rng(5)
SYS = RNG.integers(10, 4000, 96).tolist()  # 3 blocks, shared by every session
U1, U2, U3 = (RNG.integers(10, 4000, 70).tolist() for _ in range(3))
P1 = SYS + U1  # s1: 5 full blocks
P2 = SYS + U2  # s2, branch a: 5 full blocks
P2B = SYS + U2[:40] + U3  # s2, branch b: forks after block 3
FLOOD = [RNG.integers(10, 4000, 330).tolist() for _ in range(2)]  # 10 blocks each


@pytest.fixture(scope="module")
def engine():
    engine_id = new_engine_id()
    llm = tiny_llm(
        kv_transfer_config(engine_id, cpu_bytes=G2_CHUNKS * BLOCK_BYTES),
        poison=False,
        block_size=BLOCK,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    remove_offload_region(engine_id)


def parts(llm):
    core = llm.llm_engine.engine_core.engine_core
    conn = core.scheduler.connector
    return conn.index, conn.scheduler.manager, core.scheduler.kv_cache_manager.block_pool


def run(llm, session, prompt):
    eng = llm.llm_engine
    eng.add_request(
        f"{session}-{len(prompt)}-{RNG.integers(1 << 30)}",
        {"prompt_token_ids": prompt},
        PARAMS,
        session_id=session,
    )
    while eng.has_unfinished_requests():
        eng.step()


def truth(llm, keys):
    """Copies per key in G1 (vLLM's block pool) and G2 (the primary tier)."""
    _, manager, pool = parts(llm)
    ctx = ReqContext(req_id="probe")
    g1 = {k: int(pool.get_cached_block(k[:-4], [0]) is not None) for k in keys}
    g2 = {k: int(manager.primary_tier.lookup(k, ctx) is LookupResult.HIT) for k in keys}
    return g1, g2


def expected_frontiers(branches, resident):
    """Per branch, its deepest resident block; then drop tips another covers."""
    tips = set()
    for chain in branches:
        live = [k for k in chain if k in resident]
        if live:
            tips.add(live[-1])
    chains = {k: c[: c.index(k) + 1] for c in branches for k in c}
    return sorted(t for t in tips if not any(t != o and t in chains[o] for o in tips))


def check(llm, sessions):
    index, _, _ = parts(llm)
    every = sorted({k for chains in sessions.values() for c in chains for k in c})
    g1, g2 = truth(llm, every)
    resident = {k for k in every if g1[k] or g2[k]}
    got = index.resolve_keys(every)
    assert set(got.per_tier[Tier.G1]) == {k for k in every if g1[k]}
    assert set(got.per_tier[Tier.G2]) == {k for k in every if g2[k]}
    for k in every:
        assert (k in index) == (k in resident)  # pruned exactly when nothing holds it
    for name, branches in sessions.items():
        fronts = expected_frontiers(branches, resident)
        assert index.frontiers(name) == fronts, name
        members = {k for c in branches for k in c if k in resident}
        members = {
            k
            for k in members
            if any(k in c[: c.index(f) + 1] for c in branches for f in fronts if f in c)
        }
        assert set(index.resolve_session(name).keys) == members, name
    return resident


def test_index_follows_vllm_and_the_tiers(engine):
    llm = engine
    k1, k2, k2b = keys_of(llm, P1), keys_of(llm, P2), keys_of(llm, P2B)
    assert (len(k1), len(k2), len(k2b)) == (5, 5, 6) and k2b[:4] == k2[:4]
    run(llm, "s1", P1)
    run(llm, "s2", P2)
    run(llm, "s2", P2B)
    run(llm, "s3", P1)  # pure cache hits: s3 stores nothing
    sessions = {"s1": [k1], "s2": [k2, k2b], "s3": [k1]}
    index, _, _ = parts(llm)
    assert index.frontiers("s2") == sorted([k2[-1], k2b[-1]])
    assert index.sessions_of(k1[0]) == ["s1", "s2", "s3"]
    assert index.sessions_of(k2b[-1]) == ["s2"]
    resident = check(llm, sessions)
    assert set(k1 + k2 + k2b) <= resident

    assert llm.reset_prefix_cache()  # G1 dropped: G2 still holds every block
    resident = check(llm, sessions)
    g1, g2 = truth(llm, sorted(resident))
    assert not any(g1.values()) and all(g2.values())

    for prompt in FLOOD:  # 20 new blocks through a 16-chunk G2
        run(llm, None, prompt)
    resident = check(llm, sessions)
    assert not set(k1 + k2 + k2b) <= resident  # the flood evicted session blocks
