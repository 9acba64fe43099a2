"""The reference router on real parts: two vLLM servers with G3 on one
Mooncake Store, session state in a real Redis, the router in its own process
(``sessionkv router --config``).

A session's turns stick to one worker; when that worker is made busy (long
requests sent to it directly), the session moves: the router Shares it from
the old worker and the new one serves the prefix from G3. Every turn ran alone
on its engine, so its greedy tokens and logprobs equal a cold recompute of
the same prompt (a fresh ``cache_salt``: no cached block matches). A router
killed mid-run and started again keeps every session on its worker.
"""

import contextlib
import threading
import time
import uuid

import numpy as np
import pytest
import redis
import requests

from sessionkv.devtools.engines import TINY
from sessionkv.devtools.router_process import RouterProcess, engine_pair
from sessionkv.devtools.server import free_port
from sessionkv.router.auth import admin_token

SECRET = b"router-e2e-secret-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {admin_token(SECRET)}"}
RNG = np.random.default_rng(5)
NEW = [RNG.integers(10, 4000, n).tolist() for n in (150, 50, 40, 30, 60, 60)]
MAX_LOAD = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mooncake, redis_url):
    d = tmp_path_factory.mktemp("router")
    with engine_pair(d, mooncake, SECRET) as (workers, servers):
        yield d, workers, servers, redis_url


def router_config(workers, redis_url, namespace, **policy):
    return {
        "version": 1,
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "secret_file": None,
        "redis": {"url": redis_url, "namespace": namespace},
        "workers": workers,
        "routing": {"max_load": MAX_LOAD, "load_poll_s": 0.2},
        "policy": {"move_wait_s": 30, **policy},
    }


def start_router(cluster, namespace, **policy):
    d, workers, _, redis_url = cluster
    cfg = router_config(workers, redis_url, namespace, **policy)
    cfg["secret_file"] = str(d / "secret")
    return RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")


def body(prompt, **kw):
    return {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        **kw,
    }


def tokens(resp):
    return [int(t.split(":")[1]) for t in resp["choices"][0]["logprobs"]["tokens"]]


def outputs(resp):
    lp = resp["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]


def turn(router, session, prompt, headers=None):
    """One turn through the router: (worker, response JSON, report blocks)."""
    r = router.post("/v1/completions", body(prompt), {"X-Session-ID": session, **(headers or {})})
    out = r.json()
    return r.headers["X-SessionKV-Worker"], out, out["kv_transfer_params"]["sessionkv"]


def cold(server, prompts):
    """The session replayed alone on ``server`` from KV computed afresh (a new
    cache salt: no cached block matches the router's run): each turn's
    (outputs, {"recomputed": prompt tokens not served from a cache}). A turn's cached prefix holds KV
    computed by earlier turns' prefills and decode steps, whose last bits
    differ from one long prefill's; the replay computes the same KV the same
    way, so tokens and logprobs must be equal."""
    salt, out = uuid.uuid4().hex, []
    for prompt in prompts:
        r = requests.post(
            server.url + "/v1/completions", json=body(prompt, cache_salt=salt), timeout=300
        )
        r.raise_for_status()
        rep = r.json()["kv_transfer_params"]["sessionkv"]
        # Unsigned: no cache counts (report.per_tier: signed, the default);
        # vLLM's usage has them (--enable-prompt-tokens-details).
        assert rep["tokens"] is None and rep["cached_tokens"] is None, rep
        usage = r.json()["usage"]
        out.append(
            (
                outputs(r.json()),
                {
                    "recomputed": usage["prompt_tokens"]
                    - usage["prompt_tokens_details"]["cached_tokens"]
                },
            )
        )
    return out


def busy(server, n=24, max_tokens=900):
    """Start ``n`` long requests on ``server`` directly; the threads."""

    def one(i):
        prompt = np.random.default_rng(100 + i).integers(10, 4000, 60).tolist()
        requests.post(
            server.url + "/v1/completions",
            json={
                "model": TINY,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
            timeout=600,
        )

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_for(cond, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def moved(cluster):
    """Session ``agent``: two turns, its worker made busy, a third turn moves."""
    _, _, servers, _ = cluster
    router = start_router(cluster, f"r-{uuid.uuid4().hex[:6]}", tool_call={"pin": True})
    turns, prompt = [], NEW[0]
    try:
        for i, extra in enumerate(NEW[1:4]):
            if i == 2:  # before the third turn, make the session's worker busy
                old = turns[-1][0]
                threads = busy(servers[old])
                wait_for(
                    lambda: (
                        next(w for w in router.status()["workers"] if w["name"] == old)["load"]
                        >= MAX_LOAD
                    ),
                    "the router to see the worker busy",
                )
            # a gap long enough that the Pin outlives the flood on a slow machine
            headers = {"X-Session-Tool-Gap": "120"} if i == 1 else None
            worker, out, report = turn(router, "agent", prompt, headers)
            turns.append((worker, prompt, out, report))
            prompt = prompt + tokens(out) + extra
        status = router.status()
        status["log"] = router.read_log()[-6000:]
        for t in threads:
            t.join()
        worker, out, report = turn(router, "agent", prompt)  # after the load is gone
        turns.append((worker, prompt, out, report))
        status["after"] = {"workers": router.status()["workers"], "log": router.read_log()[-8000:]}
        yield router, turns, status
    finally:
        router.stop()


def test_session_sticks_then_moves_and_reads_its_prefix_from_g3(moved):
    router, turns, status = moved
    (w1, _, _, r1), (w2, _, _, r2), (w3, p3, _, r3), (w4, _, _, r4) = turns
    # a string, not a tuple: pytest prints it whole (the router's log)
    assert w1 == w2 and w3 != w1 and w4 == w3, (
        f"{[t[0] for t in turns]}\n{status['after']['workers']}\n{status['after']['log']}"
    )
    assert r2["blocks"]["g1"] >= 4  # affinity: turn 1's blocks in G1
    # The tool-gap turn carried a signed Pin; the engine took it.
    assert [(h["action"], h["status"] in ("accepted", "deferred")) for h in r2["hints"]] == [
        ("kv.pin", True)
    ], r2["hints"]
    # The move's Share, first: when it failed, the moved turn's miss below is why.
    outcomes = status["outcomes"]
    assert "hint_errors" not in status["events"], status["log"]
    assert outcomes["share"]["control"] == {"deferred": 1}, (outcomes, status["log"])
    assert outcomes["share"]["final"] == {"accepted": 1}, (outcomes, status["log"])
    # The moved turn: the prefix up to turn 2's last full block came from G3.
    full = (len(turns[1][1]) + 5) // 32
    assert r3["blocks"]["g3"] == full and r3["blocks"]["g1"] == r3["blocks"]["g2"] == 0, (
        r3,
        outcomes,
        status["events"],
        status["log"],
    )
    assert r3["tokens"]["recomputed"] == len(p3) - 32 * full
    assert outcomes["pin"]["request"] == {"accepted": 1} or outcomes["pin"]["request"] == {
        "deferred": 1
    }, outcomes
    assert status["events"]["moves"] == 1 and status["events"]["sessions_new"] == 1
    assert r4["blocks"]["g1"] + r4["blocks"]["g2"] >= full  # back at home on the new worker


def test_every_turn_equals_a_cold_recompute(moved, cluster):
    _, _, servers, _ = cluster
    _, turns, _ = moved
    ref = cold(servers[turns[-1][0]], [prompt for _, prompt, _, _ in turns])
    assert ref[0][1]["recomputed"] == len(turns[0][1])
    for i, ((_, _prompt, out, report), (want, served)) in enumerate(zip(turns, ref)):
        # the same prefix came from a cache (G1 here, G1/G3 in the router's run)
        assert served["recomputed"] == report["tokens"]["recomputed"], (i, served, report)
        assert outputs(out) == want, f"turn {i + 1}: {report}"


def test_router_metrics_count_what_status_counts(moved):
    """``GET /metrics`` (Prometheus text, parsed with prometheus-client's own
    parser) after the moved session's four turns: the counts of
    ``/router/status``, per-worker turns and a TTFT per turn."""
    from prometheus_client.parser import text_string_to_metric_families

    router, turns, _ = moved

    def scrape():
        r = requests.get(router.url + "/metrics", timeout=10)
        r.raise_for_status()
        assert r.headers["Content-Type"].startswith("text/plain")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text)
            for s in f.samples
        }

    for _ in range(20):  # the policy's hints may land between the two reads
        before, got, after = router.status(), scrape(), router.status()
        if before == after:
            break
        time.sleep(0.5)
    status = after

    def value(name, **labels):
        return got.get((name, tuple(sorted(labels.items()))), 0)

    per_worker = {}
    for worker, *_ in turns:
        per_worker[worker] = per_worker.get(worker, 0) + 1
    for worker, n in per_worker.items():
        assert value("sessionkv_router_requests_total", worker=worker, status="200") == n
        assert value("sessionkv_router_ttft_seconds_count", worker=worker) == n
        assert value("sessionkv_router_worker_healthy", worker=worker) == 1
    assert status["requests"] == {w: {"200": n} for w, n in per_worker.items()}
    for action, vias in status["outcomes"].items():
        for via, statuses in vias.items():
            for st, n in statuses.items():
                assert (
                    value("sessionkv_router_hint_outcomes_total", action=action, via=via, status=st)
                    == n
                ), (action, via, st)
    for event, n in status["events"].items():
        assert value("sessionkv_router_events_total", event=event) == n, event
    assert value("sessionkv_router_events_total", event="moves") == 1
    assert value("sessionkv_router_events_total", event="sessions_new") == 1
    # The tool-gap turn's Pin went on the request; the move's Share over the channel.
    assert value("sessionkv_router_hints_sent_total", via="request") == 1
    assert value("sessionkv_router_hints_sent_total", via="control") >= 1
    for tier, n in status["blocks"].items():
        assert value("sessionkv_router_prompt_blocks_total", tier=tier) == n


def test_router_restart_keeps_sessions_workers(cluster):
    namespace = f"r-{uuid.uuid4().hex[:6]}"
    router = start_router(cluster, namespace)
    placed, prompts = {}, {}
    try:
        for i, s in enumerate(("x", "y", "z")):
            # unrelated prompts: a shared prefix would send them together (overlap routing)
            prompts[s] = np.random.default_rng(50 + i).integers(10, 4000, 40 + 30 * i).tolist()
            placed[s] = turn(router, s, prompts[s])[0]
    finally:
        router.kill()  # a crash: nothing saved on the way out
    assert set(placed.values()) == {"a", "b"}, placed  # new sessions spread
    router = start_router(cluster, namespace, on_end="demote")
    try:
        for s in ("z", "y", "x"):  # another order than the placement's
            worker, _, report = turn(router, s, prompts[s] + NEW[5])
            assert worker == placed[s]
            assert report["blocks"]["g1"] + report["blocks"]["g2"] >= len(prompts[s]) // 32
        assert router.status()["events"].get("sessions_new", 0) == 0
        r = requests.post(router.url + "/v1/sessions/x/end", timeout=30)
        assert r.json() == {"ended": True, "worker": placed["x"]}
        assert requests.get(router.url + "/v1/sessions/x", timeout=10).status_code == 404
        outcomes = router.status()["outcomes"]
        assert outcomes["demote"]["control"] in ({"deferred": 1}, {"accepted": 1}), outcomes
    finally:
        router.stop()


def test_idle_sessions_end_and_tool_gaps_warm_up(cluster):
    router = start_router(
        cluster,
        f"r-{uuid.uuid4().hex[:6]}",
        idle_timeout_s=1.0,
        on_end="free",
        warmup={"enabled": True, "lead_s": 0.5},
    )
    try:
        worker, _, report = turn(router, "quiet", NEW[4][:70], {"X-Session-Tool-Gap": "1"})
        wait_for(lambda: router.status()["events"].get("warmups") == 1, "the warm-up", 30)
        wait_for(
            lambda: requests.get(router.url + "/v1/sessions/quiet", timeout=10).status_code == 404,
            "the idle end",
            30,
        )
        # The record goes first, then the engine is told (its outcome follows).
        wait_for(lambda: "end_session" in router.status()["outcomes"], "the end's outcome", 30)
        st = router.status()
        assert st["events"]["ended_idle"] == 1 and st["events"].get("hint_errors", 0) == 0
        assert "demote" not in st["outcomes"] and st["outcomes"]["end_session"]["control"] == {
            "accepted": 1
        }, st["outcomes"]
    finally:
        router.stop()


def test_the_policy_retains_an_idle_session_and_reranks_it(cluster):
    """The router's hint policy on real engines: a session idle after its turn
    is Retained over the control channel (outcome accepted), re-ranked as it
    idles (recency: its priority falls with idle time; a 1 s tick and a 1 s
    prior gap make that quick), and its next turn reads its prefix from
    cache with outputs equal to a cold recompute."""
    _, _, servers, _ = cluster
    router = start_router(
        cluster, f"r-{uuid.uuid4().hex[:6]}", strategy="recency", tick_s=1, prior_gap_s=1
    )
    try:
        first = np.random.default_rng(77).integers(10, 4000, 100).tolist()
        worker, out1, _ = turn(router, "keep", first)
        wait_for(
            lambda: router.status()["policy"]["engines"][worker]["reranked"] >= 2,
            "two re-ranks of the idle session",
            30,
        )
        st = router.status()
        retains = st["outcomes"]["retain"]["policy"]
        assert retains.get("accepted", 0) >= 2 and "rejected" not in retains, st["outcomes"]
        eng = st["policy"]["engines"][worker]
        # sized from the engine's hello: G2 chunks x blocks per chunk, G1 blocks
        assert eng["strategy"] == "recency" and eng["g2_blocks"] > 0 and eng["g1_blocks"] > 0
        assert "hint_errors" not in st["events"], router.read_log()[-3000:]
        second = first + tokens(out1) + NEW[2]
        w2, out2, rep2 = turn(router, "keep", second)
        assert w2 == worker and rep2["blocks"]["g1"] + rep2["blocks"]["g2"] >= len(first) // 32
        ref = cold(servers[worker], [first, second])
        assert [outputs(out1), outputs(out2)] == [r[0] for r in ref]
        chat_turns_are_tokenized_and_retained(router, servers)
    finally:
        router.stop()


def chat(url, messages, headers=None, **kw):
    r = requests.post(
        url + "/v1/chat/completions",
        headers=headers or {},
        timeout=300,
        json={
            "model": TINY,
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            **kw,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    lp = out["choices"][0]["logprobs"]["content"]
    return (
        r.headers.get("X-SessionKV-Worker"),
        out,
        [
            (t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
            for t in lp
        ],
    )


def chat_turns_are_tokenized_and_retained(router, servers):
    """A chat session (no token ids: the router asks the engine's /tokenize,
    with the model's chat template) gets Retains the engine resolves
    (accepted; none missing or clipped), and its turns equal a cold
    recompute."""

    def retains():
        return router.status()["outcomes"]["retain"]["policy"]

    before = retains()
    words = np.random.default_rng(78).integers(0, 10_000, 60)  # about 300 tokens
    text = " ".join(f"w{w}" for w in words)
    msgs = [{"role": "user", "content": text}]
    worker, out1, lp1 = chat(router.url, msgs, {"X-Session-ID": "chat"})
    wait_for(
        lambda: retains().get("accepted", 0) > before.get("accepted", 0),
        "the chat session's Retain",
        30,
    )
    st = router.status()
    assert st["events"].get("prompts_tokenized", 0) >= 1, st["events"]
    assert "tokenize_failures" not in st["events"], st["events"]
    # the router's keys are the engine's: its Retain names a boundary the
    # engine holds (a wrong key would come back missing or clipped)
    after = retains()
    assert [after.get(k, 0) for k in ("missing", "clipped")] == [
        before.get(k, 0) for k in ("missing", "clipped")
    ], after
    msgs2 = msgs + [
        {"role": "assistant", "content": out1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then?"},
    ]
    w2, _, lp2 = chat(router.url, msgs2, {"X-Session-ID": "chat"})
    salt = uuid.uuid4().hex
    refs = [chat(servers[worker].url, m, cache_salt=salt)[2] for m in (msgs, msgs2)]
    assert w2 == worker and [lp1, lp2] == refs


def test_a_drained_worker_demotes_its_sessions_and_they_move_to_g3_reads(cluster):
    """``POST /router/workers/{name}/drain`` before an engine is stopped: the
    session on it is Demoted (outcome accepted), its next turn goes to the
    other worker and reads its prefix from G3, exactly; a new session avoids
    the draining worker; ``DELETE`` ends the drain. Only with the admin
    token: a client's own key, or none, gets 401 and drains nothing."""
    _, _, servers, _ = cluster
    router = start_router(cluster, f"r-{uuid.uuid4().hex[:6]}")
    try:
        first = np.random.default_rng(91).integers(10, 4000, 130).tolist()
        w1, out1, _ = turn(router, "leaving", first)
        for who in ({}, {"Authorization": "Bearer client-key"}):
            for call in (requests.post, requests.delete):
                r = call(f"{router.url}/router/workers/{w1}/drain", headers=who, timeout=10)
                assert r.status_code == 401, r.text
        assert not next(w for w in router.status()["workers"] if w["name"] == w1)["draining"]
        r = requests.post(f"{router.url}/router/workers/{w1}/drain", headers=ADMIN, timeout=90)
        assert r.status_code == 200 and r.json() == {
            "worker": w1,
            "draining": True,
            "sessions": 1,
            "demoted": {"accepted": 1},
        }, r.text
        assert next(w for w in router.status()["workers"] if w["name"] == w1)["draining"]
        second = first + tokens(out1) + NEW[5]
        w2, out2, rep2 = turn(router, "leaving", second)
        assert w2 != w1 and rep2["blocks"]["g3"] >= len(first) // 32 - 1, rep2
        assert turn(router, "fresh", NEW[4])[0] == w2
        ref = cold(servers[w2], [first, second])
        assert [outputs(out1), outputs(out2)] == [x[0] for x in ref]
        r = requests.delete(f"{router.url}/router/workers/{w1}/drain", headers=ADMIN, timeout=10)
        assert r.json() == {"worker": w1, "draining": False}
        assert (
            requests.post(
                f"{router.url}/router/workers/nope/drain", headers=ADMIN, timeout=10
            ).status_code
            == 404
        )
    finally:
        router.stop()


def test_odd_session_ids_and_bodies_get_a_clear_400(cluster):
    """A body ``session_id`` with a NUL (which could not be echoed in
    ``X-Session-ID``: was a 500) or too long gets a 400 naming the field; so
    do a body nested too deep and ``kv_transfer_params`` that is no object
    (both were 500s)."""
    router = start_router(cluster, f"r-{uuid.uuid4().hex[:6]}")
    try:
        for sid, why in [("a\x00b", "control characters"), ("x" * 300, "1..128")]:
            r = requests.post(
                router.url + "/v1/completions",
                json={**body(NEW[0][:40]), "session_id": sid},
                timeout=60,
            )
            assert r.status_code == 400, r.text
            assert "session_id" in r.json()["error"]["message"] and why in r.text
        deep = "[" * 100_000 + "]" * 100_000
        for data, why in [
            (deep, "nested too deep"),
            ('{"prompt": [1], "kv_transfer_params": [1]}', "kv_transfer_params"),
        ]:
            r = requests.post(
                router.url + "/v1/completions",
                data=data,
                timeout=60,
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    finally:
        router.stop()


def test_redis_down_keeps_routing_and_a_restart_without_it_starts(cluster, tmp_path):
    """The router's own Redis (a real server) stops after the first turn: the
    next turns stay on the session's worker (this replica's memory) and
    succeed, a turn the engine finished is never turned into an error, and a
    router restarted while Redis is down starts and serves. Outputs equal a
    cold recompute."""
    from sessionkv.devtools.services import start_redis

    d, workers, servers, _ = cluster
    url, redis_server = start_redis(tmp_path)
    cfg = router_config(workers, url, f"r-{uuid.uuid4().hex[:6]}")
    cfg["secret_file"] = str(d / "secret")
    router = RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")
    prompt, turns = NEW[2], []
    try:
        try:
            turns.append((prompt, *turn(router, "down", prompt)))
            redis_server.stop()
            for extra in (NEW[3][:20], NEW[4][:20]):
                prompt = prompt + tokens(turns[-1][2]) + extra
                turns.append((prompt, *turn(router, "down", prompt)))
            state = router.status()["state"]
        finally:
            router.stop()
        assert len({w for _, w, _, _ in turns}) == 1, [w for _, w, _, _ in turns]
        assert state["errors"] > 0 and state["local_sessions"] == 1, state
        router = RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")  # Redis still down
        prompt = prompt + tokens(turns[-1][2]) + NEW[5][:20]
        turns.append((prompt, *turn(router, "down", prompt)))
    finally:
        router.stop()
        redis_server.stop()
    # After the restart, overlap routing (the engines' events) finds the prefix's worker.
    assert turns[-1][1] == turns[0][1]
    ref = cold(servers[turns[0][1]], [p for p, _, _, _ in turns])
    for i, ((_, _, out, report), (want, served)) in enumerate(zip(turns, ref)):
        assert served["recomputed"] == report["tokens"]["recomputed"], (i, served, report)
        assert outputs(out) == want, f"turn {i + 1}: {report}"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("warmup", [{}, {"warmup": {"enabled": True, "max_bytes": 32 << 20}}])
def test_the_router_keeps_request_bodies_only_for_warmups_and_bounded(cluster, warmup):
    """20 anonymous turns of 16 MiB each (a long ``user`` field) leave the
    router's memory where it was: no body is kept without warm-ups, and with
    them at most ``policy.warmup.max_bytes``."""
    router = start_router(cluster, f"r-{uuid.uuid4().hex[:6]}", **warmup)
    try:
        turn(router, "warm", NEW[1])
        before = rss_mib(router.proc.pid)
        big = "x" * (16 << 20)
        for i in range(20):
            r = requests.post(
                f"{router.url}/v1/completions",
                timeout=120,
                json={**body(NEW[2][:20], max_tokens=1), "user": big},
                headers={"X-Session-ID": f"big-{i}"},
            )
            assert r.status_code in (200, 400), r.text[:200]
        grown = rss_mib(router.proc.pid) - before
        assert grown < 120, f"the router grew {grown:.0f} MiB for 20 bodies of 16 MiB"
    finally:
        router.stop()


def running(server) -> float:
    return engine_metric(server, ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def finished_by_length(servers) -> float:
    return sum(
        engine_metric(s, ("vllm:request_success_total",), 'finished_reason="length"')
        for s in servers.values()
    )


def engine_metric(server, names: tuple, label: str = "") -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(names) and label in line
    )


def test_a_client_that_hangs_up_aborts_its_turn_on_the_engine(cluster):
    """Non-streamed turns whose clients hang up stop on the engine at once,
    none run to its length (they did: 20 of 20)."""
    _, _, servers, _ = cluster
    router = start_router(cluster, f"r-{uuid.uuid4().hex[:6]}")
    before = finished_by_length(servers)
    prompted = sum(engine_metric(s, ("vllm:prompt_tokens_total",)) for s in servers.values())
    try:

        def abandon(i):
            with contextlib.suppress(requests.exceptions.ReadTimeout):
                requests.post(
                    f"{router.url}/v1/completions",
                    timeout=(5, 6),
                    json={
                        "model": TINY,
                        "prompt": NEW[1][:20],
                        "max_tokens": 990,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                    headers={"X-Session-ID": f"gone-{i}"},
                )

        threads = [threading.Thread(target=abandon, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()

        # Turns reached the engines: their prompts were prefilled (a count that
        # only grows; the number running can be missed between polls). Not
        # necessarily all four: on a loaded machine an engine may take longer
        # than the clients' 6 s to be reached, and the router then drops the
        # turn before it starts (which is no turn run to its length either).
        def prefilled() -> float:
            return sum(engine_metric(s, ("vllm:prompt_tokens_total",)) for s in servers.values())

        try:
            wait_for(lambda: prefilled() >= prompted + 20, "a turn to start")
        except AssertionError as e:
            raise AssertionError(f"{e}; router log:\n{router.read_log()[-3000:]}") from None
        for t in threads:
            t.join()  # each client hung up after 6 s
        started = (prefilled() - prompted) // 20
        t0 = time.monotonic()
        wait_for(
            lambda: sum(running(s) for s in servers.values()) == 0,
            "the abandoned turns to leave the engines",
            timeout_s=120,
        )
        # Aborted (vLLM counts no success for them), not run to their length.
        assert finished_by_length(servers) == before, (started, time.monotonic() - t0)
    finally:
        router.stop()


def test_engines_behind_the_router_can_run_vllms_api_key(cluster, redis_url):
    """The client's ``Authorization`` goes to the engine with the turn (and
    with ``/v1/models``): an engine started with ``--api-key`` serves the
    clients holding the key and refuses the others (it refused everyone)."""
    from sessionkv.devtools.router_process import ENGINE_ARGS
    from sessionkv.devtools.server import ServerProcess

    d = cluster[0]
    engine = ServerProcess(TINY, [*ENGINE_ARGS, "--api-key", "key-a"])
    try:
        cfg = router_config(
            [{"name": "k", "url": engine.url, "plain": True}],
            redis_url,
            f"r-{uuid.uuid4().hex[:6]}",
        )
        cfg["secret_file"] = str(d / "secret")
        router = RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")
        try:
            url = router.url + "/v1/completions"
            for key, status in (("key-a", 200), ("key-b", 401)):
                r = requests.post(
                    url,
                    json=body(NEW[1][:20]),
                    timeout=60,
                    headers={"Authorization": f"Bearer {key}", "X-Session-ID": f"auth-{key}"},
                )
                assert r.status_code == status, r.text
                m = requests.get(
                    router.url + "/v1/models",
                    timeout=10,
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert m.status_code == status, m.text
        finally:
            router.stop()
    finally:
        engine.stop()


def test_a_stopped_redis_costs_one_timeout_and_health_says_so(cluster, tmp_path):
    """redis-server stopped (SIGSTOP: a hung or partitioned server, which
    refuses nothing): each turn waits at most one Redis timeout, not the
    client's long give-up, ``/health`` says the state store is unreachable,
    and after SIGCONT the router uses Redis again. A password in the Redis
    URL never reaches the log."""
    import os
    import signal

    from sessionkv.devtools.services import start_redis

    d, workers, _, _ = cluster
    url, redis_server = start_redis(tmp_path)
    cfg = router_config(workers, url, f"r-{uuid.uuid4().hex[:6]}")
    cfg["secret_file"] = str(d / "secret")
    cfg["redis"].update(timeout_s=0.5, retry_s=2.0)
    router = RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")
    pid = redis_server.pid()
    try:
        prompt = NEW[2]
        w, out, _ = turn(router, "hung", prompt)
        os.kill(pid, signal.SIGSTOP)
        for extra in (NEW[3][:20], NEW[4][:20]):
            prompt = prompt + tokens(out) + extra
            t0 = time.monotonic()
            w2, out, _ = turn(router, "hung", prompt)
            assert time.monotonic() - t0 < 5 and w2 == w
        health = requests.get(f"{router.url}/health", timeout=5)
        assert health.status_code == 200 and health.json()["state_store"] == "unreachable"
        os.kill(pid, signal.SIGCONT)
        time.sleep(2.5)
        turn(router, "hung", prompt + tokens(out) + NEW[5][:20])
        assert requests.get(f"{router.url}/health", timeout=5).json()["state_store"] == "ok"
    finally:
        os.kill(pid, signal.SIGCONT)
        router.stop()
        redis_server.stop()
    cfg["redis"]["url"] = f"redis://admin:hunter2-{uuid.uuid4().hex}@127.0.0.1:{free_port()}/0"
    router = RouterProcess(cfg, d / f"router-{uuid.uuid4().hex[:6]}.yaml")
    try:
        turn(router, "no-redis", NEW[1])
        log = router.read_log()
        assert "redis://admin:***@" in log and "hunter2" not in log, log[-2000:]
    finally:
        router.stop()


def test_sessions_are_bound_to_their_client_and_pins_quota_per_client(cluster):
    """The router as a deputy: a session id belongs to the API key that
    started it (another key, or none, gets 403 for its turns and 404 for its
    endpoints), and router Pins are counted per client, not per session id:
    client A's second pinned session gets no Pin, client B's first still
    does. On the old code B's turn in A's session was served (and signed),
    B read and ended A's session, and A's Pins took the pool session by session."""
    router = start_router(
        cluster, f"r-{uuid.uuid4().hex[:6]}", tool_call={"pin": True, "max_pins_per_client": 1}
    )
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    gap = {"X-Session-Tool-Gap": "30"}
    url = router.url + "/v1/completions"
    try:
        _, _, rep = turn(router, "a-1", NEW[1], {**a, **gap})
        assert [(h["action"], h["status"] != "rejected") for h in rep["hints"]] == [
            ("kv.pin", True)
        ]  # a signed Pin went with the turn (G3 part deferred)
        for headers in (b, {}):
            r = requests.post(
                url, json=body(NEW[1]), timeout=60, headers={"X-Session-ID": "a-1", **headers}
            )
            assert r.status_code == 403 and "another client" in r.text
            assert (
                requests.get(
                    router.url + "/v1/sessions/a-1", headers=headers, timeout=10
                ).status_code
                == 404
            )
            assert (
                requests.post(
                    router.url + "/v1/sessions/a-1/end", headers=headers, timeout=10
                ).status_code
                == 404
            )
        assert requests.get(router.url + "/v1/sessions/a-1", headers=a, timeout=10).ok
        _, _, rep = turn(router, "a-2", NEW[2], {**a, **gap})
        assert rep["hints"] == []  # over A's quota
        _, _, rep = turn(router, "b-1", NEW[3], {**b, **gap})
        assert [(h["action"], h["status"] != "rejected") for h in rep["hints"]] == [
            ("kv.pin", True)
        ]  # a signed Pin went with the turn (G3 part deferred)
        events = router.status()["events"]
        assert (events["pins_over_quota"], events["sessions_refused"]) == (1, 2)
        # Redis loses every record (a restart without persistence): B still
        # cannot take A's session, which A goes on with.
        ns = router.config["redis"]["namespace"]
        store = redis.Redis.from_url(router.config["redis"]["url"])
        assert store.delete(*store.keys(f"{ns}:*")) > 0
        r = requests.post(url, json=body(NEW[1]), timeout=60, headers={"X-Session-ID": "a-1", **b})
        assert r.status_code == 403 and "another client" in r.text
        assert turn(router, "a-1", NEW[1], a)[0]
        assert requests.post(router.url + "/v1/sessions/a-1/end", headers=a, timeout=10).ok
    finally:
        router.stop()
