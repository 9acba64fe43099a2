"""The router as tests run it: ``sessionkv router --config`` in its own process."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid

import requests
import yaml

from sessionkv.devtools.engines import SERVER_ARGS


class RouterProcess:
    """``sessionkv router`` on ``config`` (a dict written as router.yaml);
    ``kill`` ends it at once (a crash), ``stop`` cleanly."""

    def __init__(self, config: dict, path, timeout_s: float = 60):
        path.write_text(yaml.safe_dump(config))
        self.config = config
        self.url = f"http://127.0.0.1:{config['listen']['port']}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sessionkv-router-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessionkv.cli", "router", "--config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited during start:\n{self.read_log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"router not healthy after {timeout_s} s:\n{self.read_log()}")
            time.sleep(0.2)

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def status(self) -> dict:
        return requests.get(self.url + "/router/status", timeout=10).json()

    def post(self, path: str, body: dict, headers: dict | None = None) -> requests.Response:
        r = requests.post(self.url + path, json=body, headers=headers or {}, timeout=300)
        r.raise_for_status()
        return r

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


ENGINE_ARGS = [
    *SERVER_ARGS,
    "--max-num-seqs",
    "8",
    "--enable-prompt-tokens-details",
]  # the cold replays read vLLM's cached_tokens


@contextlib.contextmanager
def engine_pair(d, mooncake, secret: bytes, multiprocessing: str = "1"):
    """Two tiny vLLM servers ``a`` and ``b`` with G3 on one Mooncake Store
    (a fresh namespace) and control channels keyed by ``secret`` (written to
    ``d/secret``): (router worker entries, {name: ServerProcess})."""
    from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
    from sessionkv.devtools.server import ServerProcess, remove_offload_region
    from sessionkv.devtools.services import lan_address

    (d / "secret").write_bytes(secret)
    (d / "tiers.yaml").write_text(
        "version: 1\nlimits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
        f"trust: {{secret_file: {d / 'secret'}}}\n"
    )
    tier = {
        "type": "MooncakeTier",
        "module_path": "sessionkv.tiers.g3.backends.mooncake",
        "master": mooncake.master,
        "metadata_server": mooncake.metadata_url,
        "local_hostname": lan_address(),
        "namespace": f"router-{uuid.uuid4().hex[:8]}",
        "timeout_s": 10.0,
    }
    engines, workers = [], []
    try:
        for name in "ab":
            engine_id = new_engine_id()
            cfg = kv_transfer_config(
                engine_id,
                secondary_tiers=[tier],
                sessionkv={
                    "policy_file": str(d / "tiers.yaml"),
                    "control": {"endpoint_file": str(d / f"{name}.json")},
                },
            )
            engines.append(
                (
                    ServerProcess(
                        TINY,
                        [*ENGINE_ARGS, "--kv-transfer-config", json.dumps(cfg)],
                        env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing},
                    ),
                    engine_id,
                )
            )
            workers.append(
                {"name": name, "url": engines[-1][0].url, "endpoint_file": str(d / f"{name}.json")}
            )
        yield workers, {w["name"]: s for w, (s, _) in zip(workers, engines)}
    finally:
        for srv, engine_id in engines:
            srv.stop()
            remove_offload_region(engine_id)
