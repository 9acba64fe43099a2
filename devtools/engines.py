"""Helpers for tests and benches that run real vLLM engines with SessionTierConnector."""

from __future__ import annotations

import itertools
import mmap
import os
import uuid
from pathlib import Path

import numpy as np

from sessionkv.devtools.server import offload_region_path
from sessionkv.report import RequestReport

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("SESSIONKV_MODELS", ROOT / ".cache" / "models"))
TINY = str(MODELS / "tiny")
POISON_EXT = "sessionkv.devtools.kvpoison.KVPoisonExtension"
# ``vllm serve`` of the tiny model as the tests run it (``tiny_llm``'s, as flags).
SERVER_ARGS = (
    "--enforce-eager --block-size 32 --max-model-len 1024 --dtype float32 --seed 0".split()
)
# In-process engines start in ~10 s instead of ~35 s; a small G1 lets several
# of them fit next to each other.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def use_engine_env() -> None:
    """Set ``ENGINE_ENV`` in this process (where not set already): call it
    before the first engine starts (vLLM reads these at engine start)."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def kv_transfer_config(engine_id: str, cpu_bytes: int = 64 << 20, **extra) -> dict:
    """``--kv-transfer-config`` of an engine with our connector. Generated
    tokens are offloaded too (``offload_prompt_only`` false, unless ``extra``
    says otherwise): the e2e tests and benches check agents' turns reusing
    them; the connector's default is vLLM's, prompt only
    (tests/connectors/test_offload_prompt_only.py)."""
    return {
        "kv_connector": "SessionTierConnector",
        "kv_connector_module_path": "sessionkv.connectors.vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes,
            "offload_prompt_only": False,
            **extra,
        },
    }


def new_engine_id() -> str:
    return f"skvtest-{uuid.uuid4().hex[:12]}"


def poison_g2(engine_id: str, seed: int = 1) -> None:
    """Overwrite the whole G2 host region of an engine with random bytes,
    straight through its shared-memory file (no sessionkv code involved)."""
    with open(offload_region_path(engine_id), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        arr = np.frombuffer(m, dtype=np.uint8)
        arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
        del arr


_REQ_IDS = itertools.count()


def serve(llm, prompt, params, session=None, kv_hints=None):
    """One request alone (serial) through the engine API, which carries
    session_id and kv_hints: (token ids, logprobs per step, report)."""
    engine = llm.llm_engine
    req_id = f"req-{next(_REQ_IDS)}"
    engine.add_request(
        req_id, {"prompt_token_ids": prompt}, params, session_id=session, kv_hints=kv_hints
    )
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req_id and o.finished:
                out = o
    comp = out.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in comp.logprobs or ()]
    return list(comp.token_ids), logprobs, RequestReport.from_params(out.kv_transfer_params)


def final_outcome(client, hint_id, after, timeout_s=30.0):
    """The final outcome of a deferred control hint and the G2<->G3 transfer
    it made (None when it moved nothing), read from the event log (the
    engine may stay idle)."""
    from sessionkv.events import Transfer

    outcome = client.final_outcome(hint_id, after, timeout_s)
    transfer = next(
        (
            ev
            for ev in client.events(after=after).events
            if isinstance(ev, Transfer) and ev.hint_id == hint_id
        ),
        None,
    )
    return outcome, transfer


def control_hint(client, verb, session, **kw):
    """A control hint: (its first outcome, its final one, its transfer)."""
    after = client.events(after=0, limit=1).next_seq - 1
    first = getattr(client, verb)(session, **kw)
    if first.status != "deferred":
        return first, first, None
    return (first, *final_outcome(client, first.hint_id, after))


def engine_process(tmp_path, spec: dict) -> dict:
    """Run ``devtools/g3_engine.py`` (its own process: vLLM keeps one worker-side KV
    connector per process, so engines sharing KV cannot share a process) on
    ``spec``; its output, with ``log``: the tail of the engine's stderr (for
    failure messages)."""
    import json
    import subprocess
    import sys

    spec_path, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    p = subprocess.run(
        [sys.executable, "-m", "sessionkv.devtools.g3_engine", str(spec_path), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return {**json.loads(out.read_text()), "log": p.stderr[-4000:]}


def tiny_llm(kv_transfer_config: dict, poison: bool = True, **overrides):
    """An in-process engine as the tests and benches run one: the tiny model,
    eager, seed 0, float32, 1,024 tokens, 32-token blocks, with
    ``kv_transfer_config``; with the worker extension that poisons KV
    (``kvpoison.py``) unless ``poison`` is false. ``overrides`` replace or
    add ``vllm.LLM`` arguments."""
    from vllm import LLM

    args: dict = dict(
        model=TINY,
        enforce_eager=True,
        block_size=32,
        max_model_len=1024,
        seed=0,
        dtype="float32",
        kv_transfer_config=kv_transfer_config,
    )
    if poison:
        args["worker_extension_cls"] = POISON_EXT
    return LLM(**{**args, **overrides})
