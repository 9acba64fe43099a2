"""Pin and Retain in G2 on real vLLM (tiny model, 12-chunk G2, G1 poisoned).

Outputs are compared with cold references in tokens and logprobs; G2 contents
are read from the primary tier itself.
"""

import json
import threading

import numpy as np
import pytest
from vllm import SamplingParams
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from sessionkv.devtools.engines import (
    kv_transfer_config,
    new_engine_id,
    serve,
    tiny_llm,
)
from sessionkv.devtools.server import remove_offload_region
from sessionkv.events import Outcome, Via
from sessionkv.hints import sign

BLOCK = 32
CHUNK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4
G2_CHUNKS = 12
SECRET = b"pin-retain-router-secret-0123456789"
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
RNG = np.random.default_rng(21)
# 200 tokens: 6 full blocks and a partial one (a prompt that ends on a block
# boundary recomputes its last token alone, which changes the last bits).
P = {name: RNG.integers(10, 4000, 200).tolist() for name in "SLHTFGXYK"}


def make_engine(tmp_path_factory, eviction):
    d = tmp_path_factory.mktemp("pin")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(
        f"g2: {{eviction: {eviction}}}\n"
        "limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
        "report: {per_tier: all}\n"  # the test client reads where KV came from
        f"trust: {{secret_file: {d / 'secret'}}}\n"
    )
    engine_id = new_engine_id()
    llm = tiny_llm(
        kv_transfer_config(
            engine_id,
            cpu_bytes=G2_CHUNKS * CHUNK_BYTES,
            sessionkv={"policy_file": str(d / "tiers.yaml")},
        ),
        block_size=BLOCK,
    )
    return llm, engine_id


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    llm, engine_id = make_engine(tmp_path_factory, "session")
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    remove_offload_region(engine_id)


def run(llm, name, session=None, hint=None, params=PARAMS):
    """Serve a named prompt, with one signed hint when given."""
    if hint is not None:
        env = {"protocol_version": "1.0", "message_id": hint["action_id"], "actions": [hint]}
        params = params.clone()
        params.extra_args = {
            "kv_transfer_params": {"kv_hints": env, "kv_hints_sig": sign(env, session, SECRET)}
        }
    return serve(llm, P[name], params, session)


def pin(ttl=300):
    return {
        "action_id": "pin",
        "action_type": "kv.pin",
        "action_version": "1.0",
        "payload": {"ttl_s": ttl},
    }


def retain(priority):
    return {
        "action_id": "ret",
        "action_type": "kv.retain",
        "action_version": "1.0",
        "payload": {"priority": priority},
    }


def cold(llm, *names):
    out = {}
    for n in names:
        assert llm.reset_prefix_cache(reset_connector=True)
        out[n] = run(llm, n)[:2]
    assert llm.reset_prefix_cache(reset_connector=True)
    return out


def reset_g1(llm):
    assert llm.reset_prefix_cache()
    (n,) = llm.collective_rpc("poison_kv", args=(json.dumps(None), "4"))
    assert n > 0


def manager(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.manager


def in_g2(llm, name):
    """How many of a prompt's full blocks the primary tier holds."""
    from sessionkv.devtools.keys import keys_of

    ctx = ReqContext(req_id="probe")
    tier = manager(llm).primary_tier
    return sum(tier.lookup(k, ctx) is LookupResult.HIT for k in keys_of(llm, P[name]))


def test_a_pinned_session_survives_a_flood_its_twin_does_not(engine):
    llm = engine
    ref = cold(llm, "S", "T")
    _, _, rep = run(llm, "S", session="s", hint=pin())
    assert [(o.status, o.blocks_affected) for o in rep.hints] == [("accepted", 6)]
    run(llm, "T", session="t")
    flood_then_serve(llm, ref)


def flood_then_serve(llm, ref):
    """S pinned, T not, both in G2: a 12-chunk flood keeps S and takes T; S is
    then served from G2 exactly (G1 poisoned), T recomputed."""
    run(llm, "F")
    run(llm, "G")  # 12 new chunks through a 12-chunk G2
    assert (in_g2(llm, "S"), in_g2(llm, "T")) == (6, 0)
    reset_g1(llm)
    tok, lps, rep = run(llm, "S", session="s")
    assert (tok, lps) == ref["S"] and rep.blocks.g2 == 6
    tok, lps, rep = run(llm, "T", session="t")
    assert tok == ref["T"][0] and (rep.blocks.g2, rep.tokens.recomputed) == (0, 200)


def test_retain_the_lower_priority_goes_first(engine):
    llm = engine
    ref = cold(llm, "H")
    assert run(llm, "L", session="lo", hint=retain(1))[2].hints[0].status == "accepted"
    assert run(llm, "H", session="hi", hint=retain(9))[2].hints[0].status == "accepted"
    run(llm, "F")  # G2 was full of L and H: 6 must go
    assert (in_g2(llm, "L"), in_g2(llm, "H")) == (0, 6)
    reset_g1(llm)
    tok, lps, rep = run(llm, "H", session="hi")
    assert (tok, lps) == ref["H"] and rep.blocks.g2 == 6


def test_pin_everything_then_keep_serving_pins_are_clipped(engine):
    llm = engine
    refs = cold(llm, "X", "Y", "F")
    events = manager(llm).event_log
    _, _, start = events.since(0, 0)
    for name in "SL":
        assert run(llm, name, session=name, hint=pin())[2].hints[0].blocks_affected == 6
    for name in "XYF":  # G2 is all pins: no stall, pins clipped
        tok, lps, _ = run(llm, name)
        assert (tok, lps) == refs[name]
    late = [
        e.outcome
        for e in events.since(start - 1, 1 << 20)[0]
        if isinstance(e, Outcome) and e.via is Via.POLICY
    ]
    assert late and all(o.status == "clipped" and o.action == "kv.pin" for o in late)
    assert sum(o.blocks_affected for o in late) >= 6


def test_hints_racing_the_scheduler(engine):
    """Threads apply Pin/Retain/end-session under the lock while the engine
    serves: no crash, no assertion from vLLM's managers, outputs unchanged."""
    llm = engine
    refs = cold(llm, *"SLHTFG")
    mgr = manager(llm)
    stop = threading.Event()
    errors = []

    def hammer(seed):
        from sessionkv.hints import Action, Bounds, KvHint, SessionTarget

        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                s = str(rng.choice(list("SLHTFG")))
                action = Action.PIN if rng.random() < 0.5 else Action.RETAIN
                hint = KvHint(
                    "race",
                    action,
                    SessionTarget(s),
                    Bounds(ttl_s=float(rng.integers(1, 5)), priority=int(rng.integers(0, 9))),
                    signed=True,
                )
                with mgr.lock:
                    mgr.service.executor.execute(hint, s)
                    mgr.service.collect_clipped()
                    if rng.random() < 0.05:
                        mgr.index.end_session(s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(30):
            name = "SLHTFG"[i % 6]
            tok, _, _ = run(llm, name, session=name)
            assert tok == refs[name][0]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


def test_unhinted_g2_evicts_like_vllms_lru_side_by_side(engine, tmp_path_factory):
    """The same script through vLLM's own LRU policy and ours: the same G2."""
    lru, lru_id = make_engine(tmp_path_factory, "lru")
    try:
        script = ["S", "L", "S", "H", "T", "L", "F", "S", "G", "X", "H", "Y"]
        for llm in (engine, lru):
            assert llm.reset_prefix_cache(reset_connector=True)
            for name in script:
                run(llm, name)
        assert [in_g2(engine, n) for n in "SLHTFGXY"] == [in_g2(lru, n) for n in "SLHTFGXY"]
    finally:
        lru.llm_engine.engine_core.shutdown()
        remove_offload_region(lru_id)
