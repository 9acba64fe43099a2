"""Helpers for tests that run real vLLM engines with SessionTierConnector."""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import requests

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


def region_path(engine_id: str) -> Path:
    return Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")


def poison_g2(engine_id: str, seed: int = 1) -> None:
    """Overwrite the whole G2 host region of an engine with random bytes,
    straight through its shared-memory file (no sessionkv code involved)."""
    with open(region_path(engine_id), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        arr = np.frombuffer(m, dtype=np.uint8)
        arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
        del arr


def remove_region(engine_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        region_path(engine_id).unlink()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server in a subprocess, on 127.0.0.1."""

    def __init__(self, model: str, args: list[str], env: dict | None = None, timeout: float = 240):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/sessionkv-server-{self.port}.log", "w+")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.tail(1 << 20)}")
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server did not start: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
