"""The OpenAI server (real vLLM, tiny model) with SessionTierConnector over HTTP."""

import json

import numpy as np
import pytest
import requests

from sessionkv.devtools import engines
from sessionkv.devtools.engines import POISON_EXT, TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region
from sessionkv.report import RequestReport

BLOCK = 32
SERVER_ARGS = [
    *engines.SERVER_ARGS,
    "--worker-extension-cls",
    POISON_EXT,
    "--enable-prompt-tokens-details",
]
# The server runs its engine core in a child process, as in production.
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1"}
PROMPT = np.random.default_rng(11).integers(10, 4000, 200).tolist()  # 6 full blocks
LAST_USAGE: dict[str, dict] = {}  # server URL -> the last completion's usage


@pytest.fixture(scope="module")
def server():
    engine_id = new_engine_id()
    cfg = json.dumps(kv_transfer_config(engine_id))
    srv = ServerProcess(TINY, [*SERVER_ARGS, "--kv-transfer-config", cfg], env=SERVER_ENV)
    yield srv
    srv.stop()
    remove_offload_region(engine_id)


def complete(srv, prompt, session):
    body = {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "session_id": session,
    }
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    LAST_USAGE[srv.url] = out["usage"]
    choice = out["choices"][0]
    lp = choice["logprobs"]
    return (
        choice["text"],
        lp["tokens"],
        lp["token_logprobs"],
        lp["top_logprobs"],
    ), RequestReport.from_params(out.get("kv_transfer_params"))


def usage_cached(srv) -> int:
    """vLLM's own count of the last completion's cached prompt tokens
    (``--enable-prompt-tokens-details``): G1 hits and the connector's loads."""
    return LAST_USAGE[srv.url]["prompt_tokens_details"]["cached_tokens"]


def test_session_report_withholds_cache_counts_and_output_is_exact(server):
    # No policy file: report.per_tier is "signed" and this engine has no
    # router secret, so reports say nothing of what a cache held (vLLM's
    # usage field, enabled here by the operator, does: G2's load is read there).
    cold, rep = complete(server, PROMPT, "sess-http-1")
    assert rep.session_id == "sess-http-1"
    assert (rep.tokens, rep.blocks, rep.cached_tokens) == (None, None, None)
    assert usage_cached(server) == 0

    assert server.post("/reset_prefix_cache")["success"]
    poisoned = server.post("/collective_rpc", {"method": "poison_kv", "args": ["null", "5"]})
    assert int(poisoned["results"][0]) > 0

    warm, rep = complete(server, PROMPT, "sess-http-1")
    assert warm == cold  # tokens and logprobs, exactly
    assert rep.session_id == "sess-http-1"
    # G1 was reset and poisoned: the 6 cached blocks were loaded from G2.
    assert (rep.tokens, rep.cached_tokens) == (None, None) and usage_cached(server) == 6 * BLOCK


def test_bad_sessionkv_key_fails_server_start():
    cfg = kv_transfer_config(new_engine_id())
    cfg["kv_connector_extra_config"]["sessionkv"] = {"polcy_file": "tiers.yaml"}
    with pytest.raises(RuntimeError, match="unknown key sessionkv.'polcy_file'"):
        ServerProcess(TINY, [*SERVER_ARGS, "--kv-transfer-config", json.dumps(cfg)], env=SERVER_ENV)
