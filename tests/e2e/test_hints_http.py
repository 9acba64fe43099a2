"""Hints over HTTP on a live engine: trust, and 1,000 hostile envelopes.

Every request must be served correctly (its greedy tokens equal the same
prompt's reference; requests run concurrently, so tokens only) and its
response must carry exactly one outcome per hint.
"""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from sessionkv.devtools.engines import SERVER_ARGS, TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.hint_cases import expected_count, hostile_envelope, hostile_kvcr
from sessionkv.devtools.server import ServerProcess, remove_offload_region
from sessionkv.hints import envelope, sign
from sessionkv.report import RequestReport

SECRET = b"router-secret-for-tests-0123456789"
ARGS = [*SERVER_ARGS, "--max-num-seqs", "16"]
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(10, 4000, n).tolist() for n in (40, 70, 100, 130)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("hints")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(f"version: 1\ntrust:\n  secret_file: {d / 'secret'}\n")
    engine_id = new_engine_id()
    cfg = kv_transfer_config(engine_id, sessionkv={"policy_file": str(d / "tiers.yaml")})
    srv = ServerProcess(
        TINY,
        [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    yield srv
    srv.stop()
    remove_offload_region(engine_id)


def complete(srv, prompt, session, params=None):
    body = {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "session_id": session,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["logprobs"]["tokens"], RequestReport.from_params(
        out["kv_transfer_params"]
    )


def pin(session):
    return {
        "protocol_version": "1.0",
        "message_id": "m",
        "actions": [
            {
                "action_id": "p1",
                "action_type": "kv.pin",
                "action_version": "1.0",
                "payload": {"ttl_s": 60, "target": {"session_id": session}},
            }
        ],
    }


def test_unsigned_rejected_signed_resolved_other_session_rejected(server):
    complete(server, PROMPTS[3], "s-live")  # a branch of 4 blocks
    env = pin("s-live")
    _, rep = complete(server, PROMPTS[0], "s-live", {"kv_hints": env})
    assert [(o.status, o.reason[:8]) for o in rep.hints] == [("rejected", "unsigned")]
    _, rep = complete(
        server, PROMPTS[0], "s-live", {"kv_hints": env, "kv_hints_sig": sign(env, "s-live", SECRET)}
    )
    (o,) = rep.hints
    # Hints act when their request finishes: PROMPTS[0]'s block is a second branch.
    assert (o.status, o.blocks_asked, o.blocks_affected) == ("accepted", 5, 5)
    _, rep = complete(
        server,
        PROMPTS[0],
        "s-live",
        {"kv_hints": env, "kv_hints_sig": sign(env, "s-other", SECRET)},
    )
    assert rep.hints[0].reason.startswith("unsigned")


def test_an_unsigned_turn_cannot_join_a_session_the_router_signed(server):
    """A stranger's unsigned turn naming a router's session runs without a
    session: the owner's Pin covers the owner's blocks only (it covered the
    stranger's too)."""
    env = envelope()
    _, rep = complete(
        server,
        PROMPTS[2],
        "s-owned",  # 100 tokens: 3 full blocks
        {"kv_hints": env, "kv_hints_sig": sign(env, "s-owned", SECRET)},
    )
    assert rep.session_id == "s-owned"
    _, rep = complete(server, PROMPTS[1], "s-owned")  # the stranger's 2 blocks
    assert rep.session_id is None
    p = pin("s-owned")
    _, rep = complete(
        server, PROMPTS[2], "s-owned", {"kv_hints": p, "kv_hints_sig": sign(p, "s-owned", SECRET)}
    )
    assert [(o.status, o.blocks_asked) for o in rep.hints] == [("accepted", 3)], rep.hints


def test_per_tier_counts_go_only_to_router_signed_requests(server):
    # report.per_tier: signed (the default). Per-tier counts would tell any
    # client which tier (a shared G3: another engine's traffic) held a prefix.
    complete(server, PROMPTS[2], "s-tiers")  # 100 tokens: 3 full blocks
    _, rep = complete(server, PROMPTS[2], "s-tiers")
    assert (rep.tokens, rep.blocks, rep.cached_tokens) == (None, None, None)
    env = envelope()  # no actions: how the router signs a turn it has no hint for
    for sig in (
        sign(env, "s-other", SECRET),
        sign(env, "s-tiers", SECRET, now=time.time() - 400),
        sign(env, "s-tiers", b"another-secret-0123456789"),
    ):
        _, rep = complete(server, PROMPTS[2], "s-tiers", {"kv_hints": env, "kv_hints_sig": sig})
        assert (rep.tokens, rep.hints) == (None, ()), sig
    _, rep = complete(
        server,
        PROMPTS[2],
        "s-tiers",
        {"kv_hints": env, "kv_hints_sig": sign(env, "s-tiers", SECRET)},
    )
    assert rep.hints == () and rep.cached_tokens == 96
    assert (rep.blocks.g1 + rep.blocks.g2, rep.tokens.recomputed) == (3, 4)


def test_malformed_json_never_reaches_the_connector(server):
    r = requests.post(
        server.url + "/v1/completions",
        data=b'{"model": "x", "prompt": [1,',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400


def test_a_thousand_hostile_envelopes(server):
    refs = [complete(server, p, None)[0] for p in PROMPTS]
    rng = random.Random(17)
    cases = []
    for i in range(1000):
        env, kvcr = hostile_envelope(rng), hostile_kvcr(rng)
        params = {"kv_hints": env}
        if kvcr is not None:
            params["kv_hint"] = kvcr
        if rng.random() < 0.3:
            try:
                params["kv_hints_sig"] = sign(env, rng.choice(["s-live", "x"]), SECRET)
            except (TypeError, ValueError):
                params["kv_hints_sig"] = "not-a-signature"
        cases.append(
            (
                i % len(PROMPTS),
                rng.choice(["s-live", "nobody", "h" * 100]),
                params,
                expected_count(env, kvcr),
            )
        )

    def one(case):
        p, session, params, want = case
        tokens, rep = complete(server, PROMPTS[p], session, params)
        return tokens == refs[p], len(rep.hints) == want, rep.hints

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, cases))
    assert all(ok for ok, _, _ in results), "a request with hostile hints was served wrongly"
    assert all(n for _, n, _ in results), "a response did not carry one outcome per hint"
    statuses = {o.status for _, _, hints in results for o in hints}
    assert "rejected" in statuses
