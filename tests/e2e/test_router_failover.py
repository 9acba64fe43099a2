"""Router failover and overlap routing on real parts: two vLLM servers with G3
on one Mooncake Store, session state in a real Redis, the router in its own
process.

Failover: one engine is SIGKILLed while a long turn of one of its sessions
runs there. The router retries that turn on the other engine, which reads the
session's prefix from G3 (write-through filled it before the kill); every
session of the dead engine continues on the other one, no request fails, and
every turn's tokens equal a cold replay of its session alone on the survivor
(a fresh ``cache_salt``).

Overlap: each engine answers ``probe`` and the router's own hashes match;
a new session whose prompt extends another session's goes to the worker that
holds that prefix in G1, whatever the round-robin says.
"""

import threading
import uuid

import numpy as np
import pytest
import requests

from sessionkv.devtools.engines import TINY
from sessionkv.devtools.router_process import RouterProcess, engine_pair
from sessionkv.devtools.server import free_port

SECRET = b"router-failover-secret-0123456789ab"
RNG = np.random.default_rng(11)
LONG = 300  # the turn in flight when its engine dies decodes this many


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mooncake, redis_url):
    d = tmp_path_factory.mktemp("failover")
    # one process per engine: a SIGKILL takes the whole engine
    with engine_pair(d, mooncake, SECRET, multiprocessing="0") as (workers, servers):
        yield d, workers, servers, redis_url


def start_router(cluster):
    d, workers, _, redis_url = cluster
    cfg = {
        "version": 1,
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "secret_file": str(d / "secret"),
        "redis": {"url": redis_url, "namespace": f"fo-{uuid.uuid4().hex[:6]}"},
        "workers": workers,
        "routing": {"max_load": 8, "load_poll_s": 0.2},
        "policy": {"on_end": "none"},
    }
    return RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")


def body(prompt, max_tokens=6, **kw):
    return {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        **kw,
    }


def gen_tokens(out):
    return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


def logprobs(out):
    return out["choices"][0]["logprobs"]["token_logprobs"]


def turn(router, session, prompt, max_tokens=6):
    r = router.post("/v1/completions", body(prompt, max_tokens), {"X-Session-ID": session})
    out = r.json()
    return r.headers["X-SessionKV-Worker"], out, out["kv_transfer_params"]["sessionkv"]


def wait_for(cond, what, timeout_s=60):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def worker_status(router, name):
    return next(w for w in router.status()["workers"] if w["name"] == name)


def test_overlap_routing_then_failover(cluster):
    _, _, servers, _ = cluster
    router = start_router(cluster)
    try:
        st = router.status()["workers"]
        assert all(w["overlap"] and w["probe_error"] is None for w in st), st
        # Overlap: "base" on some worker; "fork" extends its prompt and goes there,
        # whatever the round-robin (two tries: one would land there by chance).
        base = RNG.integers(10, 4000, 160).tolist()
        home, _, _ = turn(router, "base", base)
        wait_for(lambda: worker_status(router, home)["index_keys"] >= 4, "base's G1 blocks")
        for fork in ("fork1", "fork2"):
            w, _, rep = turn(router, fork, base + RNG.integers(10, 4000, 20).tolist())
            assert w == home and rep["blocks"]["g1"] >= 4, (w, home, rep)
        assert router.status()["events"]["overlap_scored"] >= 2

        # Failover: sessions on both workers, one long turn in flight on the victim.
        prompts, placed, outs = {}, {}, {}
        for i in range(4):
            s = f"s{i}"
            prompts[s] = [RNG.integers(10, 4000, 100 + 10 * i).tolist()]
            placed[s], out, _ = turn(router, s, prompts[s][0])
            outs[s] = [out]
        assert set(placed.values()) == {"a", "b"}, placed
        victim = placed["s0"]
        survivor = "b" if victim == "a" else "a"
        doomed = [s for s in placed if placed[s] == victim]
        prompts["s0"].append(
            prompts["s0"][0] + gen_tokens(outs["s0"][0]) + RNG.integers(10, 4000, 40).tolist()
        )
        result = {}
        t = threading.Thread(
            target=lambda: result.update(
                zip(("worker", "out", "report"), turn(router, "s0", prompts["s0"][1], LONG))
            )
        )
        t.start()
        wait_for(
            lambda: worker_status(router, victim)["engine_load"] >= 1,
            "the long turn to run on its engine",
        )
        servers[victim].kill()  # SIGKILL: no goodbye
        t.join(300)
        assert result.get("worker") == survivor, result
        outs["s0"].append(result["out"])
        assert gen_tokens(result["out"]).__len__() == LONG
        # the survivor read the dead engine's prefix of s0 from G3
        assert result["report"]["blocks"]["g3"] >= 1, result["report"]
        # every session continues, all on the survivor
        for s in prompts:
            prompts[s].append(
                prompts[s][-1] + gen_tokens(outs[s][-1]) + RNG.integers(10, 4000, 30).tolist()
            )
            w, out, _ = turn(router, s, prompts[s][-1])
            assert w == survivor, (s, w)
            outs[s].append(out)
        status = router.status()
        ev = status["events"]
        assert ev["retries"] == 1 and ev["failover_moves"] == len(doomed), ev
        assert not worker_status(router, victim)["healthy"]
        # tokens equal a cold replay of each session alone on the survivor
        for s in prompts:
            salt = uuid.uuid4().hex
            for i, (prompt, out) in enumerate(zip(prompts[s], outs[s])):
                n = LONG if (s, i) == ("s0", 1) else 6
                r = requests.post(
                    servers[survivor].url + "/v1/completions",
                    json=body(prompt, n, cache_salt=salt),
                    timeout=300,
                )
                r.raise_for_status()
                assert gen_tokens(out) == gen_tokens(r.json()), (s, i)
                np.testing.assert_allclose(
                    logprobs(out), logprobs(r.json()), atol=1e-3, err_msg=f"{s} turn {i + 1}"
                )
    finally:
        router.stop()
