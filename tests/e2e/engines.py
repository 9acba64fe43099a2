"""Helpers for tests that run real vLLM engines with SessionTierConnector."""

from __future__ import annotations

import itertools
import mmap
import os
import uuid
from pathlib import Path

import numpy as np

from sessionkv.report import RequestReport
from sessionkv.server import offload_region_path

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("SESSIONKV_MODELS", ROOT / ".cache" / "models"))
TINY = str(MODELS / "tiny")
POISON_EXT = "kvpoison.KVPoisonExtension"


def kv_transfer_config(engine_id: str, cpu_bytes: int = 64 << 20, **extra) -> dict:
    return {
        "kv_connector": "SessionTierConnector",
        "kv_connector_module_path": "sessionkv.connectors.vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, **extra},
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
    engine.add_request(req_id, {"prompt_token_ids": prompt}, params, session_id=session,
                       kv_hints=kv_hints)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == req_id and o.finished:
                out = o
    comp = out.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in comp.logprobs or ()]
    return list(comp.token_ids), logprobs, RequestReport.from_params(out.kv_transfer_params)
