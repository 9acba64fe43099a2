"""The router under a flood: many sessions, large bodies, slow clients.

    python bench/router_flood.py --json OUT [--sessions 10000] [--bodies 20]

Starts redis-server, the tiny model's API server (a plain worker: no
connector, so every byte measured is the router's) and ``sessionkv router``
with ``policy.max_sessions`` and ``policy.warmup.max_bytes`` set, then
measures the router process's resident set after each phase:

1. **sessions**: ``--sessions`` turns, each of a new session (32 clients at
   once; the engine refuses them at once, ``max_tokens: 0``, so the router's
   bookkeeping is what is measured);
2. **bodies**, then **bodies_more**: ``--bodies`` turns of 16 MiB each (a long
   ``user`` field) in two halves, with warm-ups on, so the last bodies are
   kept up to ``warmup.max_bytes``: the second half must not grow the router;
3. **slow clients**: ``--slow`` connections that send half a request's
   headers and then nothing, under ``listen.header_timeout_s`` of
   ``HEADER_TIMEOUT_S``: counted still open after 2 s (``slow_clients_held``)
   and closed by the router 3 s past its deadline (``slow_clients_closed``).

Keys: ``{"config": {...}, "phases": {name: {"rss_mib", "growth_mib", "s"}},
"rss_start_mib", "goals": {...}, "ok"}``; the goals: the sessions phase grows
the router by at most 64 MiB for 10,000 sessions, both halves of the bodies
together (``bodies_all``) by at most ``warmup.max_bytes`` plus six bodies (one
turn's copies in flight), and slow clients by at most 64 MiB, every one of
them closed by the router. ``ok`` says all hold. Exit status 0 either way (the JSON is the verdict).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from sessionkv.devtools.engines import TINY
from sessionkv.devtools.router_process import ENGINE_ARGS, RouterProcess
from sessionkv.devtools.server import ServerProcess, free_port
from sessionkv.devtools.services import start_redis

SECRET = b"router-flood-bench-secret-0123456789"
MIB = 1 << 20
WARMUP_BYTES = 64 * MIB
BODY_MIB = 16
HEADER_TIMEOUT_S = 5  # listen.header_timeout_s, short so the bench sees it
# A turn in flight holds its body a few times over (the request's bytes, its
# parsed document, the forwarded JSON, the engine's reply): the allocator
# keeps that high-water mark, once.
TRANSIENT_BODIES = 6
GOALS = ("sessions", "bodies_all", "slow_clients")  # phases with a growth goal


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def phase(router: RouterProcess, out: dict, name: str, fn) -> None:
    before, t0 = rss_mib(router.proc.pid), time.monotonic()
    fn()
    time.sleep(1.0)
    after = rss_mib(router.proc.pid)
    out[name] = {
        "rss_mib": round(after, 1),
        "growth_mib": round(after - before, 1),
        "s": round(time.monotonic() - t0, 1),
    }
    print(f"{name}: {out[name]}", file=sys.stderr, flush=True)


def run(sessions: int, bodies: int, slow: int, d: Path) -> dict:
    (d / "secret").write_bytes(SECRET)
    redis_server = engine = router = None
    phases: dict = {}
    try:
        url, redis_server = start_redis(d)
        engine = ServerProcess(TINY, ENGINE_ARGS)
        cfg = {
            "version": 1,
            "listen": {
                "host": "127.0.0.1",
                "port": free_port(),
                "header_timeout_s": HEADER_TIMEOUT_S,
            },
            "secret_file": str(d / "secret"),
            "redis": {"url": url, "namespace": "flood"},
            "workers": [{"name": "a", "url": engine.url, "plain": True}],
            "policy": {
                "strategy": "plain",
                "max_sessions": sessions // 2,
                "warmup": {"enabled": True, "max_bytes": WARMUP_BYTES},
            },
        }
        router = RouterProcess(cfg, d / "router.yaml")
        start = rss_mib(router.proc.pid)

        def turn(i: int, extra: dict | None = None) -> int:
            body = {"model": TINY, "prompt": [1, 2, 3, 4], "max_tokens": 0, **(extra or {})}
            r = requests.post(
                f"{router.url}/v1/completions",
                json=body,
                timeout=120,
                headers={"X-Session-ID": f"flood-{i}"},
            )
            return r.status_code

        def many() -> None:
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(turn, range(sessions)))

        payload = "x" * (BODY_MIB * MIB)

        def big(first: int, n: int) -> None:
            for i in range(first, first + n):
                turn(sessions + i, {"max_tokens": 1, "user": payload})

        def slow_clients() -> None:
            host, port = "127.0.0.1", cfg["listen"]["port"]
            socks = []
            for _ in range(slow):
                s = socket.create_connection((host, port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
                socks.append(s)
            time.sleep(2)
            phases["slow_clients_held"] = sum(1 for s in socks if _open(s))
            time.sleep(HEADER_TIMEOUT_S + 1)
            phases["slow_clients_closed"] = sum(1 for s in socks if not _open(s))
            for s in socks:
                s.close()

        phase(router, phases, "sessions", many)
        half = bodies // 2
        phase(router, phases, "bodies", lambda: big(0, half))
        phase(router, phases, "bodies_more", lambda: big(half, bodies - half))
        phase(router, phases, "slow_clients", slow_clients)
        status = router.status()
    finally:
        for part in (router, engine, redis_server):
            if part is not None:
                part.stop()
    # Both halves of the bodies together: where the allocator's high-water
    # mark lands (first half or second) varies from run to run.
    phases["bodies_all"] = {
        "growth_mib": round(phases["bodies"]["growth_mib"] + phases["bodies_more"]["growth_mib"], 1)
    }
    goals = {
        "sessions_growth_mib_max": 64 * sessions / 10_000,
        "bodies_all_growth_mib_max": WARMUP_BYTES / MIB + TRANSIENT_BODIES * BODY_MIB,
        "slow_clients_growth_mib_max": 64,
    }
    ok = (
        all(phases[name]["growth_mib"] <= goals[f"{name}_growth_mib_max"] for name in GOALS)
        and phases["slow_clients_closed"] == slow
    )
    return {
        "config": {
            "sessions": sessions,
            "bodies": bodies,
            "body_mib": BODY_MIB,
            "slow": slow,
            "max_sessions": cfg["policy"]["max_sessions"],
            "warmup_max_bytes": WARMUP_BYTES,
        },
        "rss_start_mib": round(start, 1),
        "phases": phases,
        "router_requests": status.get("requests"),
        "goals": goals,
        "ok": ok,
    }


def _open(s: socket.socket) -> bool:
    """Whether the router still holds the connection (no EOF yet)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--bodies", type=int, default=20)
    p.add_argument("--slow", type=int, default=500)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sessionkv-router-flood-") as d:
        out = run(args.sessions, args.bodies, args.slow, Path(d))
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
