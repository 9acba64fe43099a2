"""Helpers for tests that run real vLLM engines with SessionTierConnector."""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import numpy as np

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
