"""Graceful drain on real vLLM servers (tiny model, G3 on Redis with
write-through off, so that only the drain sends KV down): a server started
with vLLM's ``--shutdown-timeout`` and stopped with SIGTERM Demotes its live session to G3 before it exits and leaves no G2
region in /dev/shm; the session's next turn on another engine, whose G2
starts full of garbage, loads its prefix from G3 and gives the cold run's
tokens and logprobs."""

import json
import os
import signal
import threading
import time
import uuid

import numpy as np
import redis

from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id, poison_g2
from sessionkv.devtools.router_process import ENGINE_ARGS
from sessionkv.devtools.server import ServerProcess, offload_region_path
from sessionkv.report import RequestReport

SECRET = b"drain-e2e-secret-0123456789abcdef"
P = np.random.default_rng(21).integers(10, 4000, 200).tolist()  # 6 full blocks of 32


def start(tmp_path, name: str, redis_url: str, ns: str) -> tuple[ServerProcess, str]:
    (tmp_path / "secret").write_bytes(SECRET)
    policy = tmp_path / f"{name}.yaml"
    policy.write_text(
        "version: 1\ng3: {write_through: false}\nreport: {per_tier: all}\n"
        f"sessions: {{drain_timeout_s: 30}}\n"
        f"trust: {{secret_file: {tmp_path / 'secret'}}}\n"
    )
    engine_id = new_engine_id()
    tier = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": redis_url,
        "namespace": ns,
        "timeout_s": 10.0,
    }
    cfg = kv_transfer_config(
        engine_id, secondary_tiers=[tier], sessionkv={"policy_file": str(policy)}
    )
    # vLLM's own engine-core process, as `vllm serve` runs by default; a
    # graceful shutdown (vLLM's default 0 kills the engine core at once).
    srv = ServerProcess(
        TINY,
        [*ENGINE_ARGS, "--shutdown-timeout", "40", "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    return srv, engine_id


def complete(
    srv: ServerProcess, prompt: list[int], session: str | None = None, salt: str | None = None
) -> tuple[list[int], list[float], RequestReport]:
    body = {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    if session:
        body["session_id"] = session
    if salt:
        body["cache_salt"] = salt
    out = srv.post("/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    toks = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    return toks, lp["token_logprobs"], RequestReport.from_params(out["kv_transfer_params"])


def group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_drains_live_sessions_to_g3_and_removes_the_g2_region(tmp_path, redis_url):
    ns = f"drain-{uuid.uuid4().hex[:8]}"
    started: dict[str, tuple[ServerProcess, str]] = {}
    threads = [
        threading.Thread(
            target=lambda n=n: started.__setitem__(n, start(tmp_path, n, redis_url, ns))
        )
        for n in "ab"
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a, a_id), (b, b_id) = started["a"], started["b"]
    try:
        _, _, report = complete(a, P, session="s")
        assert report.blocks.recomputed == 7
        store = redis.Redis.from_url(redis_url)
        assert not store.keys(f"{ns}*")  # write-through is off: nothing down yet

        assert os.path.exists(offload_region_path(a_id))
        a.proc.send_signal(signal.SIGTERM)  # what an orchestrator sends
        assert a.proc.wait(120) is not None
        assert group_gone(a.proc.pid, 60), "the engine core outlived its server"
        assert not os.path.exists(offload_region_path(a_id)), "the G2 region was left behind"
        assert store.keys(f"{ns}*"), "the drain demoted nothing to G3"

        poison_g2(b_id)  # only a correct load gives the reference
        toks, logprobs, report = complete(b, P, session="s")
        assert report.blocks.g3 == 6, report
        ref_toks, ref_logprobs, ref = complete(b, P, salt=uuid.uuid4().hex)
        assert ref.blocks.recomputed == 7
        assert (toks, logprobs) == (ref_toks, ref_logprobs)
    finally:
        a.stop()
        b.stop()
