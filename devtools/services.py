"""The shared services G3 needs, started on this machine with health checks:
``mooncake_master``, standalone Mooncake store processes (``mooncake_client``,
which hold the storage, so objects outlive any engine), ``redis-server``, and
LMCache's storage server (``lmcache_server``).

Used by ``scripts/services start|stop|status`` and by the tests. Servers bind
127.0.0.1 where they can; Mooncake's store processes listen on all
interfaces and need a non-loopback address to advertise (``lan_address``):
run them inside a private network namespace where the machine allows it
(``scripts/test`` does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent


def lan_address() -> str:
    """The address Mooncake processes advertise: ``SESSIONKV_LAN_ADDRESS``
    (scripts/test sets it inside its namespace), else this host's first
    non-loopback IPv4 address."""
    env = os.environ.get("SESSIONKV_LAN_ADDRESS")
    if env:
        return env
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    v4 = [a for a in out if "." in a and not a.startswith("127.")]
    if not v4:
        raise RuntimeError("no non-loopback IPv4 address for Mooncake to advertise")
    return v4[0]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Service:
    """One server process: its command, how to tell it is healthy, its log."""

    name: str
    cmd: list[str]
    healthy: Callable[[], bool]
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pidfile(self) -> Path:
        return self.log_dir / f"{self.name}.pid"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, timeout_s: float = 30) -> Service:
        exe = shutil.which(self.cmd[0]) or self.cmd[0]
        if not os.path.exists(exe):
            raise FileNotFoundError(f"{self.name}: {self.cmd[0]} not found (run scripts/setup)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [exe, *self.cmd[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        self.pidfile.write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start:\n{self.tail()}")
            if self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid if self.proc.poll() is None else None
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
            return pid
        return None

    def signal(self, sig: int) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, sig)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a stopped process cannot exit
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid, self.proc):
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                if _alive(pid, self.proc):
                    os.kill(pid, signal.SIGKILL)
            if self.proc is not None:
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()


def _alive(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@dataclass(frozen=True)
class MooncakePorts:
    rpc: int = 50051
    metadata: int = 8080
    metrics: int = 9003
    store: int = 50052

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata}/metadata"


def mooncake_master(log_dir: Path, ports: MooncakePorts = MooncakePorts()) -> Service:
    """The master with its HTTP metadata server; healthy when ``/health``
    answers on the metrics port. Soft pins hold (``--allow_evict_soft_pinned_objects=false``)."""
    return Service(
        "mooncake_master",
        [
            str(BIN / "mooncake_master"),
            "--rpc_address",
            "127.0.0.1",
            "--rpc_port",
            str(ports.rpc),
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host",
            "127.0.0.1",
            "--http_metadata_server_port",
            str(ports.metadata),
            "--metrics_port",
            str(ports.metrics),
            "--allow_evict_soft_pinned_objects=false",
        ],
        lambda: http_ok(f"http://127.0.0.1:{ports.metrics}/health"),
        log_dir,
    )


def mooncake_store(
    log_dir: Path,
    ports: MooncakePorts = MooncakePorts(),
    size: str = "512MB",
    name: str = "mooncake_store",
) -> Service:
    """A standalone store process mounting ``size`` of storage into the cluster."""
    host = lan_address()
    return Service(
        name,
        [
            str(BIN / "mooncake_client"),
            "--host",
            host,
            "--master_server_address",
            ports.master,
            "--metadata_server",
            ports.metadata_url,
            "--global_segment_size",
            size,
            "--protocol",
            "tcp",
            "--port",
            str(ports.store),
        ],
        lambda: port_open(ports.store, host),
        log_dir,
    )


def redis(log_dir: Path, port: int = 6379, maxmemory: str = "256mb") -> Service:
    """redis-server on 127.0.0.1, no persistence, ``volatile-lru`` under ``maxmemory``."""
    return Service(
        "redis",
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "volatile-lru",
            "--protected-mode",
            "yes",
        ],
        lambda: port_open(port),
        log_dir,
    )


# LMCache's server binds without SO_REUSEADDR: after a crash it could not bind
# its port again until the old connections leave TIME_WAIT (a minute). This
# runs its own main() with the option set.
LMCACHE_SERVER = """
import socket, sys
class ReuseAddress(socket.socket):
    def bind(self, address):
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        super().bind(address)
socket.socket = ReuseAddress
sys.argv[0] = "lmcache_server"
from lmcache.v1.server.__main__ import main
main()
"""


def lmcache_server(log_dir: Path, port: int = 65432) -> Service:
    """LMCache's ``lm://`` storage server (its ``lmcache_server``) on
    127.0.0.1, objects in its memory (it has no capacity limit: see
    ``tiers/g3/backends/lmcache.py``). Healthy when it answers a HEALTH request. No usage
    telemetry leaves the machine."""

    def healthy() -> bool:
        from sessionkv.tiers.g3.backends.lmcache import health

        return port_open(port) and health(f"lm://127.0.0.1:{port}")

    return Service(
        "lmcache_server",
        [sys.executable, "-c", LMCACHE_SERVER, "127.0.0.1", str(port), "cpu"],
        healthy,
        log_dir,
        env={"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"},
    )


def start_mooncake(
    log_dir: Path,
    store_size: str = "512MB",
) -> tuple[MooncakePorts, Service, Service]:
    """A master and one store process on free ports, started: (ports, master, store)."""
    from sessionkv.devtools.server import free_port

    ports = MooncakePorts(
        rpc=free_port(), metadata=free_port(), metrics=free_port(), store=free_port()
    )
    master = mooncake_master(log_dir, ports).start()
    try:
        return ports, master, mooncake_store(log_dir, ports, size=store_size).start()
    except Exception:
        master.stop()
        raise


def start_redis(log_dir: Path, maxmemory: str = "256mb") -> tuple[str, Service]:
    """redis-server on a free port, started: (its URL, the service)."""
    from sessionkv.devtools.server import free_port

    port = free_port()
    return f"redis://127.0.0.1:{port}/0", redis(log_dir, port, maxmemory).start()


def start_lmcache(log_dir: Path) -> tuple[str, Service]:
    """An LMCache server on a free port, started: (its lm:// URL, the service)."""
    from sessionkv.devtools.server import free_port

    port = free_port()
    return f"lm://127.0.0.1:{port}", lmcache_server(log_dir, port).start(timeout_s=60)


def all_services(log_dir: Path) -> list[Service]:
    return [
        mooncake_master(log_dir),
        mooncake_store(log_dir),
        redis(log_dir),
        lmcache_server(log_dir),
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="scripts/services", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["start", "stop", "status"])
    ap.add_argument(
        "--dir",
        default=os.environ.get("SESSIONKV_RUN_DIR", ".run/services"),
        help="pid files and logs",
    )
    args = ap.parse_args(argv)
    services = all_services(Path(args.dir))
    if args.command == "start":
        for s in services:
            if s.pid() is not None and s.healthy():
                print(f"{s.name}: already running (pid {s.pid()})")
                continue
            s.start()
            print(f"{s.name}: started (pid {s.pid()}), log {s.log}")
        return 0
    if args.command == "stop":
        for s in reversed(services):
            s.stop()
            print(f"{s.name}: stopped")
        return 0
    bad = 0
    for s in services:
        pid = s.pid()
        ok = pid is not None and s.healthy()
        bad += not ok
        print(
            f"{s.name}: {'healthy' if ok else 'running, unhealthy' if pid else 'stopped'}"
            + (f" (pid {pid})" if pid else "")
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
