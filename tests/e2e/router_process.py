"""The router as tests run it: ``sessionkv router --config`` in its own process."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import requests
import yaml


class RouterProcess:
    """``sessionkv router`` on ``config`` (a dict written as router.yaml);
    ``kill`` ends it at once (a crash), ``stop`` cleanly."""

    def __init__(self, config: dict, path, timeout_s: float = 60):
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{config['listen']['port']}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sessionkv-router-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessionkv.cli", "router", "--config", str(path)],
            stdout=self.log, stderr=subprocess.STDOUT)
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
