"""sessionkv's metrics on a running API server's /metrics (vLLM's own
exporter) after a scripted scenario: one cold turn, a second turn that hits
G1 and pins the session (a signed request hint), G3 on Redis written through."""

import json
import time

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from test_hints_http import ARGS, SECRET, complete, pin

from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region
from sessionkv.hints import sign

P = np.random.default_rng(5).integers(10, 4000, 100).tolist()  # 3 full blocks + 4 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_url):
    d = tmp_path_factory.mktemp("metrics")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(
        f"version: 1\nreport: {{per_tier: all}}\ntrust:\n  secret_file: {d / 'secret'}\n"
    )
    engine_id = new_engine_id()
    tier = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": redis_url,
        "namespace": f"metrics-{engine_id}",
        "timeout_s": 10.0,
    }
    cfg = kv_transfer_config(
        engine_id, secondary_tiers=[tier], sessionkv={"policy_file": str(d / "tiers.yaml")}
    )
    srv = ServerProcess(
        TINY,
        [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    yield srv
    srv.stop()
    remove_offload_region(engine_id)


def scrape(srv) -> dict[tuple, float]:
    """sessionkv's samples: (name, sorted non-vLLM labels) -> value."""
    text = requests.get(srv.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("sessionkv:") and not s.name.endswith("_created"):
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
                )
                out[(s.name, labels)] = s.value
    return out


def test_metrics_count_the_scenario(server):
    complete(server, P, "m")  # cold: 100 recomputed
    env = pin("m")
    _, rep = complete(server, P, "m", {"kv_hints": env, "kv_hints_sig": sign(env, "m", SECRET)})
    # Deferred while the cold turn's G3 copies are still being written (the Pin
    # holds them too; accepted when they were done first, as on a loaded
    # machine): the final outcome is what counts.
    assert rep.tokens.g1 == 96 and [o.status for o in rep.hints] in (["deferred"], ["accepted"])
    want = {
        ("sessionkv:hint_outcomes_total", (("action", "kv.pin"), ("outcome", "accepted"))): 1,
        ("sessionkv:prompt_tokens_total", (("source", "g1"),)): 96,
        ("sessionkv:moved_blocks_total", (("dst", "G2"), ("src", "G1"))): 3,
        ("sessionkv:moved_bytes_total", (("dst", "G2"), ("src", "G1"))): 3
        * 2
        * 2
        * 2
        * 64
        * 32
        * 4,
        ("sessionkv:moved_blocks_total", (("dst", "G3"), ("src", "G2"))): 3,
        ("sessionkv:index_blocks", ()): 3,
        ("sessionkv:pinned_chunks", ()): 3,
    }
    # Stats reach /metrics with the engine's steps, and G3 writes end on their
    # own: short requests (no full block, no session) let them through.
    deadline, got = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        got = scrape(server)
        if all(got.get(k) == v for k, v in want.items()):
            break
        complete(server, [11, 12, 13], None)
        time.sleep(0.5)
    assert {k: got.get(k) for k in want} == want
    recomputed = got[("sessionkv:prompt_tokens_total", (("source", "recomputed"),))]
    assert recomputed >= 104 and recomputed % 1 == 0
    ratio = got[("sessionkv:hit_ratio", (("tier", "g1"),))]
    assert ratio == pytest.approx(96 / (96 + recomputed))
