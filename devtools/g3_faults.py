"""The G3 fault scenario, shared by tests/e2e/test_g3_faults.py (which asserts
on it) and bench/g3_faults.py (which writes its figures as JSON).

One engine in this process (tiny model, 12-chunk G2, a G3 tier whose
deadline is 1 s while a backend process is stopped, continued or killed, and
10 s otherwise) and its own backend processes (Mooncake: master and store
process; Redis: the server; LMCache: its lm:// server). Prompts of 6 full
blocks; G1 is reset and poisoned before every request, and G2 holds only two
prompts, so most turns come from G3.
Phases: cold, normal, then for each backend process: stopped (SIGSTOP, and a
reset while stopped), continued, killed, restarted (a new prompt must come
back from G3 within 60 s). Every request's tokens and logprobs are compared with its cold
reference, and every engine step is timed.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
import uuid
from pathlib import Path

import numpy as np

from sessionkv.devtools.engines import (
    kv_transfer_config,
    new_engine_id,
    poison_g2,
    tiny_llm,
    use_engine_env,
)
from sessionkv.devtools.keys import keys_of
from sessionkv.report import RequestReport
from sessionkv.tiers.g3.tier import Guard

BLOCK = 32
CHUNK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4
G2_CHUNKS = 12
RNG = np.random.default_rng(41)
PROMPTS = {n: RNG.integers(10, 4000, 200).tolist() for n in "ABCDEFGHIJKLMNOPW"}
BACKENDS = ("mooncake", "redis", "lmcache")
RETRY_S = 0.5
# The healthy phases only set the scene (everything in G3, then served from
# it): a healthy backend's answer can take over 1 s on a loaded 2-core CI
# machine, which made the normal phase a run of misses. Deadlines are the
# subject of the fault phases, which run with the short one; recovery after
# a restart is checked with the long one.
HEALTHY_TIMEOUT_S = 10.0
FAULT_TIMEOUT_S = 1.0
RECOVERY_S = 60.0


def make_engine(tier: dict, workdir: Path):
    """An engine on ``tier`` with the cluster secret in its policy: its G3
    objects are sealed with the MAC key derived from it."""

    engine_id = new_engine_id()
    tier = {
        **tier,
        "namespace": f"faults-{uuid.uuid4().hex[:8]}",
        "timeout_s": HEALTHY_TIMEOUT_S,
        "retry_s": RETRY_S,
    }
    secret, policy = workdir / "cluster.secret", workdir / "policy.yaml"
    secret.write_text("g3-faults-cluster-secret-0123456789")
    # report.per_tier all: the bench reads which tier served each request.
    policy.write_text(f"version: 1\nreport: {{per_tier: all}}\ntrust: {{secret_file: {secret}}}\n")
    extra = {"secondary_tiers": [tier], "sessionkv": {"policy_file": str(policy)}}
    # 64 G1 blocks, not the 16,384 a 1 GiB CPU KV cache holds: G1 is poisoned
    # before every request, and writing 1 GiB of noise each time starved the
    # backend's threads of CPU (its calls missed the 1 s deadline in the
    # normal phase on this 2-core machine).
    llm = tiny_llm(
        kv_transfer_config(engine_id, cpu_bytes=G2_CHUNKS * CHUNK_BYTES, **extra),
        block_size=BLOCK,
        num_gpu_blocks_override=64,
    )
    return llm, engine_id


_ids = iter(range(1 << 30))


def serve_timed(llm, name):
    """One request alone; (tokens, logprobs, report, step durations in s)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    req_id = f"f-{next(_ids)}"
    engine.add_request(
        req_id,
        {"prompt_token_ids": PROMPTS[name]},
        SamplingParams(temperature=0, max_tokens=6, logprobs=2),
        session_id=name,
    )
    out, steps = None, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        for o in outs:
            if o.request_id == req_id and o.finished:
                out = o
    comp = out.outputs[0]
    lps = [{t: lp.logprob for t, lp in s.items()} for s in comp.logprobs]
    return list(comp.token_ids), lps, RequestReport.from_params(out.kv_transfer_params), steps


def fresh_g1(llm, seed=5):
    assert llm.reset_prefix_cache()
    (n,) = llm.collective_rpc("poison_kv", args=(json.dumps(None), str(seed)))
    assert n > 0


def run(llm, engine_id, victims) -> dict:
    """The scenario (module docstring). ``victims``: (label, ``Service``) of
    the backend processes to stop, kill and restart, in order."""
    phases: dict[str, dict] = {}
    wrong: list[str] = []
    refs: dict[str, tuple] = {}
    fresh = iter("EFGHIJKLMNOP")
    tier = llm.llm_engine.engine_core.engine_core.scheduler.connector.manager.secondary_tiers[0]

    def phase(label, names):
        steps, sources = [], {"g1": 0, "g2": 0, "g3": 0, "recomputed": 0}
        t0, trips0 = time.monotonic(), tier.guard.trips
        for name in names:
            fresh_g1(llm)
            tok, lps, rep, st = serve_timed(llm, name)
            if name not in refs:
                refs[name] = (tok, lps)
            elif (tok, lps) != refs[name]:
                wrong.append(f"{label}:{name}")
            steps += st
            for k in sources:
                sources[k] += getattr(rep.blocks, k)
        phases[label] = {
            "requests": len(names),
            "steps": len(steps),
            "max_step_s": max(steps),
            "median_step_s": float(np.median(steps)),
            "blocks": sources,
            "wall_s": time.monotonic() - t0,
            "g3_trips": tier.guard.trips - trips0,
        }

    phase("warmup", "W")  # the engine's first, slow steps: before anything to G3
    phase("cold", "ABCD")  # references; everything to G3
    # The normal phase starts with G2 empty (the reset drains the G3 stores
    # first); cold prompts whose store missed its deadline are recorded.
    assert llm.reset_prefix_cache(reset_connector=True)
    phases["cold"]["missing_in_g3"] = "".join(
        n for n in "ABCD" if not all(tier.listed(keys_of(llm, PROMPTS[n])))
    )
    phase("normal", "ABCDABCD")
    for who, service in victims:
        tier.guard.timeout_s = FAULT_TIMEOUT_S
        service.signal(signal.SIGSTOP)
        try:
            phase(f"{who}_stopped", "ABCD")
            t0 = time.monotonic()  # reset drains the tier's jobs: bounded too
            assert llm.reset_prefix_cache(reset_connector=True)
            phases[f"{who}_stopped"]["reset_s"] = time.monotonic() - t0
        finally:
            service.signal(signal.SIGCONT)
        time.sleep(1.0)  # past the breaker's retry
        phase(f"{who}_continued", "ABCD")
        service.signal(signal.SIGKILL)
        service.proc.wait()
        phase(f"{who}_killed", "ABCD")
        # Restarted: a new prompt goes down to G3 and, with G1 and G2 emptied
        # and poisoned, must come back from it. The backend needs a while to
        # be whole again (a restarted Mooncake master waits for the store
        # process to mount its memory again), so new prompts are tried until
        # one comes back, for at most RECOVERY_S.
        service.proc = None
        service.start()
        # Whether the tier finds the backend again by itself is the subject
        # here, not how fast it answers: the healthy deadline again.
        tier.guard.timeout_s = HEALTHY_TIMEOUT_S
        started = time.monotonic()
        for attempt in itertools.count(1):
            time.sleep(RETRY_S * Guard.MAX_BACKOFF + 0.5)  # the breaker's longest delay
            name = next(fresh)
            phase(f"{who}_restarted_cold", name)
            assert llm.reset_prefix_cache(reset_connector=True)
            poison_g2(engine_id, seed=len(phases))
            phase(f"{who}_restarted", name)
            done = phases[f"{who}_restarted"]
            done.update(attempts=attempt, recovered_s=time.monotonic() - started)
            if done["blocks"]["g3"] == 6 or done["recovered_s"] > RECOVERY_S:
                break
    return {"phases": phases, "wrong": wrong}


def scenario(log_dir: Path, backend: str) -> dict:
    """Own backend processes and engine, the whole run, everything stopped after."""
    from sessionkv.devtools.server import remove_offload_region
    from sessionkv.devtools.services import lan_address, start_lmcache, start_mooncake, start_redis

    if backend == "mooncake":
        ports, master, store = start_mooncake(log_dir)
        services = [("master", master), ("store", store)]
        tier = {
            "type": "MooncakeTier",
            "module_path": "sessionkv.tiers.g3.backends.mooncake",
            "master": ports.master,
            "metadata_server": ports.metadata_url,
            "local_hostname": lan_address(),
        }
    elif backend == "redis":
        url, server = start_redis(log_dir)
        services = [("redis", server)]
        tier = {"type": "RedisTier", "module_path": "sessionkv.tiers.g3.backends.redis", "url": url}
    else:
        url, server = start_lmcache(log_dir)
        services = [("lmcache", server)]
        tier = {
            "type": "LMCacheTier",
            "module_path": "sessionkv.tiers.g3.backends.lmcache",
            "url": url,
        }
    try:
        llm, engine_id = make_engine(tier, log_dir)
        try:
            return run(llm, engine_id, services)
        finally:
            llm.llm_engine.engine_core.shutdown()
            remove_offload_region(engine_id)
    finally:
        for _, s in services:
            s.stop()


def scenario_process(log_dir: Path, backend: str) -> dict:
    """``scenario`` in a process of its own (``python -m
    sessionkv.devtools.g3_faults BACKEND LOG_DIR OUT``): its backend clients, their threads and whatever a killed
    backend leaves running in them (a Mooncake read busy-polling a core)
    end with it, and nothing earlier tests left in this process slows it."""
    import subprocess
    import sys

    out = log_dir / "scenario.json"
    log = log_dir / "scenario.log"
    with log.open("w") as f:
        p = subprocess.run(
            [sys.executable, "-m", "sessionkv.devtools.g3_faults", backend, str(log_dir), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1200,
        )
    assert p.returncode == 0, log.read_text()[-8000:]
    return json.loads(out.read_text())


if __name__ == "__main__":
    import sys

    use_engine_env()
    Path(sys.argv[3]).write_text(json.dumps(scenario(Path(sys.argv[2]), sys.argv[1])))
