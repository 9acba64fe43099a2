"""The G3 fault scenario, shared by tests/e2e/test_g3_faults.py (which asserts
on it) and bench/g3_faults.py (which writes its figures as JSON).

One engine in this process (tiny model, 12-chunk G2, Mooncake G3 with a 1 s
deadline), its own mooncake_master and store process. Prompts of 6 full
blocks; G1 is reset and poisoned before every request, and G2 holds only two
prompts, so most turns come from G3. Phases: normal; master stopped
(SIGSTOP); master continued; master killed; master restarted (sharing must
work again); store process killed; store process restarted. Every request's
tokens and logprobs are compared with its cold reference, and every engine
step is timed.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path

import numpy as np

from engines import POISON_EXT, TINY, kv_transfer_config, new_engine_id, poison_g2
from sessionkv.report import RequestReport

BLOCK = 32
CHUNK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4
G2_CHUNKS = 12
RNG = np.random.default_rng(41)
PROMPTS = {n: RNG.integers(10, 4000, 200).tolist() for n in "ABCDXYZ"}


def make_engine(ports, lan, policy: Path | None = None, timeout_s: float = 1.0):
    from vllm import LLM
    engine_id = new_engine_id()
    tiers = [{"type": "MooncakeTier", "module_path": "sessionkv.tiers.mooncake",
              "master": ports.master, "metadata_server": ports.metadata_url,
              "local_hostname": lan, "namespace": f"faults-{uuid.uuid4().hex[:8]}",
              "timeout_s": timeout_s, "retry_s": 0.5}]
    extra = {"secondary_tiers": tiers}
    if policy is not None:
        extra["sessionkv"] = {"policy_file": str(policy)}
    llm = LLM(model=TINY, enforce_eager=True, block_size=BLOCK, max_model_len=1024, seed=0,
              dtype="float32", worker_extension_cls=POISON_EXT,
              kv_transfer_config=kv_transfer_config(engine_id, cpu_bytes=G2_CHUNKS * CHUNK_BYTES,
                                                    **extra))
    return llm, engine_id


_ids = iter(range(1 << 30))


def serve_timed(llm, name):
    """One request alone; (tokens, logprobs, report, step durations in s)."""
    from vllm import SamplingParams
    engine = llm.llm_engine
    req_id = f"f-{next(_ids)}"
    engine.add_request(req_id, {"prompt_token_ids": PROMPTS[name]},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=2), session_id=name)
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


def run(llm, engine_id, master, store, refs=None) -> dict:
    """The scenario (module docstring). ``master``/``store`` are
    ``sessionkv.services.Service``s this function may stop and restart."""
    phases: dict[str, dict] = {}
    wrong: list[str] = []
    refs = refs if refs is not None else {}

    def phase(label, names, before=None):
        steps, sources = [], {"g1": 0, "g2": 0, "g3": 0, "recomputed": 0}
        t0 = time.monotonic()
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
        phases[label] = {"requests": len(names), "steps": len(steps),
                         "max_step_s": max(steps), "median_step_s": float(np.median(steps)),
                         "blocks": sources, "wall_s": time.monotonic() - t0}

    phase("cold", "ABCD")                              # references; everything to G3
    phase("normal", "ABCDABCD")
    master.signal(signal.SIGSTOP)
    try:
        phase("master_stopped", "ABCD")
        t0 = time.monotonic()              # reset drains the tier's jobs: bounded too
        assert llm.reset_prefix_cache(reset_connector=True)
        phases["master_stopped"]["reset_s"] = time.monotonic() - t0
    finally:
        master.signal(signal.SIGCONT)
    time.sleep(1.0)                                    # past the breaker's retry
    phase("master_continued", "ABCD")
    master.signal(signal.SIGKILL)
    master.proc.wait()
    phase("master_killed", "ABCD")

    def restart(service, label, name):
        """Start ``service`` again; a new prompt goes down to G3 and, with G1
        and G2 emptied and poisoned, must come back from it."""
        service.proc = None
        service.start()
        time.sleep(1.0)
        phase(f"{label}_cold", name)
        assert llm.reset_prefix_cache(reset_connector=True)
        poison_g2(engine_id, seed=len(phases))
        phase(label, name)

    restart(master, "master_restarted", "X")
    store.signal(signal.SIGKILL)
    store.proc.wait()
    phase("store_killed", "ABCDX")
    restart(store, "store_restarted", "Y")
    return {"phases": phases, "wrong": wrong}


def scenario(log_dir: Path) -> dict:
    """Own services and engine, the whole run, everything stopped after."""
    from sessionkv.server import remove_offload_region
    from sessionkv.services import lan_address, start_mooncake

    ports, master, store = start_mooncake(log_dir)
    try:
        llm, engine_id = make_engine(ports, lan_address())
        try:
            return run(llm, engine_id, master, store)
        finally:
            llm.llm_engine.engine_core.shutdown()
            remove_offload_region(engine_id)
    finally:
        store.stop()
        master.stop()
