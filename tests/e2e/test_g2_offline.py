"""Real vLLM (offline engine, tiny model) serving prefix KV back from G2, exactly.

Each scenario: cold references first, then ``reset_prefix_cache()`` and poisoned
G1 blocks, then the same prompts again. Outputs must equal the cold runs in
greedy tokens and logprobs (serial prefill runs of this model are bit-exact;
KV made by decode steps is compared with vLLM's own G1 hit instead), and the
per-request report must name the G2 blocks. The negative control poisons G2 instead and
the output must change, which proves the bytes really came from G2.
"""

import json

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from sessionkv.devtools.engines import (
    kv_transfer_config,
    new_engine_id,
    poison_g2,
    serve,
    tiny_llm,
)
from sessionkv.devtools.server import remove_offload_region
from sessionkv.hints import sign
from sessionkv.tiers.g2.policy import SessionCachePolicy

BLOCK = 32
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
RNG = np.random.default_rng(7)
# Prompt lengths leave the last block partial for all 6 generated tokens, so
# every full block is offloaded while the request runs.
A = RNG.integers(10, 4000, 200).tolist()  # 6 full blocks
B = A[:160] + RNG.integers(10, 4000, 90).tolist()  # shares A's first 5 blocks
P = A[:100] + RNG.integers(10, 4000, 60).tolist()  # shares A's first 3 blocks
RNG_TURN = np.random.default_rng(8)


SECRET = b"offline-router-secret-0123456789"


@pytest.fixture(scope="module", params=[1, 2], ids=["bpc1", "bpc2"])
def engine(request, tmp_path_factory):
    bpc = request.param
    engine_id = new_engine_id()
    d = tmp_path_factory.mktemp("policy")
    (d / "secret").write_bytes(SECRET)
    # The session-aware G2 policy: un-hinted, it must serve exactly as vLLM's LRU.
    (d / "tiers.yaml").write_text(
        f"g2: {{eviction: session}}\n"
        "report: {per_tier: all}\n"  # the test reads the tiers
        f"trust: {{secret_file: {d / 'secret'}}}\n"
    )
    llm = tiny_llm(
        kv_transfer_config(
            engine_id, block_size=BLOCK * bpc, sessionkv={"policy_file": str(d / "tiers.yaml")}
        ),
        block_size=BLOCK,
    )
    yield llm, engine_id, bpc
    llm.llm_engine.engine_core.shutdown()
    del llm
    remove_offload_region(engine_id)


def run(llm, prompt, session=None, params=PARAMS, kv_hints=None):
    return serve(llm, prompt, params, session, kv_hints)


def reset_g1(llm):
    """Drop G1's prefix cache and overwrite every (now free) block with garbage."""
    assert llm.reset_prefix_cache()
    poison(llm)


def poison(llm, keep_cached=False):
    """Poison all G1 blocks, or only those holding no cached prefix."""
    ids = None
    if keep_cached:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        ids = [b.block_id for b in pool.blocks if b.block_id != 0 and b.block_hash is None]
    (n,) = llm.collective_rpc("poison_kv", args=(json.dumps(ids), "3"))
    assert n > 0


def cold(llm, *prompts):
    """Cold references, computed from an empty G1 and an empty G2."""
    refs = []
    for p in prompts:
        assert llm.reset_prefix_cache(reset_connector=True)
        refs.append(run(llm, p))
        assert refs[-1][2].tokens.recomputed == len(p)
    return refs


def test_prefix_served_from_g2_is_exact(engine):
    llm, _, bpc = engine
    (ref_b, ref_a) = cold(llm, B, A)  # A is stored in G2 last; B is not in G2
    reset_g1(llm)
    tok, lps, rep = run(llm, A)
    assert (tok, lps) == ref_a[:2]
    assert (rep.blocks.g1, rep.blocks.g2, rep.tokens.recomputed) == (0, 6, 200 - 192)

    reset_g1(llm)
    tok, lps, rep = run(llm, B)
    assert (tok, lps) == ref_b[:2]
    shared = 5 - 5 % bpc  # whole chunks of A's blocks that B shares
    assert (rep.blocks.g1, rep.blocks.g2) == (0, shared)
    assert rep.tokens.recomputed == len(B) - shared * BLOCK


def test_load_starting_mid_chunk_is_exact(engine):
    llm, _, bpc = engine
    (ref_a,) = cold(llm, A)
    reset_g1(llm)
    run(llm, P)  # G1 now holds A's first 3 blocks (via P)
    poison(llm, keep_cached=True)  # everything but those cached blocks
    tok, lps, rep = run(llm, A)
    assert (tok, lps) == ref_a[:2]
    assert (rep.blocks.g1, rep.blocks.g2) == (3, 3)


def test_generated_tokens_are_offloaded(engine):
    """An agent's next turn reuses the previous turn's output: its KV comes from G2.

    KV of generated tokens was computed by decode steps, which a full prefill
    reproduces only to the last bits; so the bit-exact reference is vLLM's own
    G1 prefix hit of the same blocks, and the cold recompute must agree in tokens.
    """
    llm, _, _ = engine
    reply = SamplingParams(temperature=0, max_tokens=72)
    assert llm.reset_prefix_cache(reset_connector=True)
    generated, _, _ = run(llm, A, params=reply)
    # 272 tokens of turn 1 (the last one never committed): 8 full blocks, the
    # last two made of generated tokens. 10 new tokens keep turn 2 under 9.
    turn2 = A + generated + RNG_TURN.integers(10, 4000, 10).tolist()
    tok_g1, lps_g1, rep = run(llm, turn2)
    assert rep.blocks.g1 == 8 and rep.blocks.g2 == 0
    reset_g1(llm)
    tok, lps, rep = run(llm, turn2)
    assert (rep.blocks.g1, rep.blocks.g2) == (0, 8)
    assert (tok, lps) == (tok_g1, lps_g1)
    (ref,) = cold(llm, turn2)
    assert tok == ref[0]


def test_the_g2_policy_is_the_session_policy(engine):
    llm, _, _ = engine
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.manager
    assert isinstance(manager.primary_tier.policy, SessionCachePolicy)


def test_session_id_reaches_the_report(engine):
    llm, _, _ = engine
    _, _, rep = run(llm, A, session="sess-offline-1")
    assert rep.session_id == "sess-offline-1"


def test_python_api_hints_reach_the_executor(engine):
    """KvHintsEnvelope through the engine API; the signature rides in kv_transfer_params."""
    llm, _, _ = engine
    env = KvHintsEnvelope("1.0", "m1", [KvHintAction("p1", "kv.pin", "1.0", {"ttl_s": 9})])
    _, _, rep = run(llm, A, session="sess-api", kv_hints=env)
    assert [(o.hint_id, o.status, o.reason[:8]) for o in rep.hints] == [
        ("p1", "rejected", "unsigned")
    ]
    signed = SamplingParams(
        temperature=0,
        max_tokens=6,
        extra_args={"kv_transfer_params": {"kv_hints_sig": sign(env, "sess-api", SECRET)}},
    )
    _, _, rep = run(llm, A, session="sess-api", params=signed, kv_hints=env)
    (o,) = rep.hints
    assert (o.status, o.blocks_asked, o.blocks_affected) == ("accepted", 6, 6)


def test_negative_control_poisoned_g2_changes_output(engine):
    llm, engine_id, _ = engine
    (ref_a,) = cold(llm, A)
    reset_g1(llm)
    poison_g2(engine_id)
    tok, lps, rep = run(llm, A)
    assert rep.blocks.g2 == 6  # the load happened, from poisoned bytes...
    assert (tok, lps) != ref_a[:2]  # ...so the output must differ
