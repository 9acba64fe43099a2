"""The control channel under a flood from peers without the secret.

    python bench/control_flood.py --json OUT [--pins 100] [--peers 64]

Starts the tiny model's API server with the control channel (a policy with a
secret), serves one turn of session ``flood-s``, then measures a real
``HintClient`` sending Pins for that session at 20 per second:

1. **unloaded**: no other peer;
2. **loaded**: while ``--peers`` peers without the secret flood the channel's
   request socket from another process: a third plain ZMQ DEALERs queueing
   4 MiB frames (what once grew an engine by 128 MiB each), a third CURVE
   clients with keys of another secret, a third raw TCP connections writing
   garbage and reconnecting.

Both phases run in the same run on the same server. The engine's memory is
the resident set of the server's whole process tree, sampled every 0.2 s.
``zap_refused`` counts the handshakes the engine's ZAP handler refused (a
client key that is not the derived one); a peer with another server key, a
plain peer and raw garbage fail before ZAP is asked.
Keys: ``{"peers", "pins", "unloaded": {"p50_ms", "p99_ms", "statuses"},
"loaded": {...}, "p50_ratio", "rss_before_mib", "rss_peak_mib",
"rss_growth_mib", "flood_frames_queued", "flood_tcp_bytes", "zap_refused",
"goals": {"rss_growth_mib_max": 64, "p50_ratio_max": 2.0}, "ok"}``; ``ok``
says both goals hold. Exit status 0 either way (the JSON is the verdict).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
import zmq
from idle_cpu import ARGS, tree_sum

from sessionkv import control as wire
from sessionkv.client import HintClient
from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region

SECRET = b"control-flood-bench-secret-0123456789"
FRAME = 4 << 20
GOALS = {"rss_growth_mib_max": 64, "p50_ratio_max": 2.0}


def tree_rss_mib(pid: int) -> float:
    return tree_sum(pid, lambda p: p.memory_info().rss) / 2**20


def flood(endpoint: str, peers: int, stop, counts) -> None:
    """The attackers (a process of their own): ZMQ's I/O threads send the
    queued frames, so the GIL does not pace them."""
    ctx = zmq.Context(io_threads=2)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    garbage = b"\xff" + b"\x00" * (FRAME - 1)
    plain_n, curve_n = peers // 3, peers // 3
    socks = []
    for i in range(plain_n + curve_n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 8)
        if i >= plain_n:
            other = wire.curve_keys(b"not-the-cluster-secret-%d" % i)
            s.curve_serverkey = other.server_public
            s.curve_publickey, s.curve_secretkey = other.client_public, other.client_secret
        s.connect(endpoint)
        socks.append(s)
    tcp_bytes = [0]

    def raw() -> None:
        chunk = b"\xff" + b"garbage!" * 8192
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=1) as c:
                    for _ in range(64):
                        c.sendall(chunk)
                        tcp_bytes[0] += len(chunk)
            except OSError:
                time.sleep(0.01)

    threads = [threading.Thread(target=raw, daemon=True) for _ in range(peers - len(socks))]
    for t in threads:
        t.start()
    queued = 0
    while not stop.is_set():
        for s in socks:
            try:
                s.send_multipart([garbage, b"\0" * 32], zmq.NOBLOCK, copy=False)
                queued += 1
            except zmq.Again:
                pass
        time.sleep(0.01)
    counts["frames"], counts["tcp_bytes"] = queued, tcp_bytes[0]
    ctx.destroy(linger=0)


def pins(client: HintClient, n: int) -> dict:
    lat, statuses = [], {}
    for _ in range(n):
        t0 = time.perf_counter()
        out = client.pin("flood-s", ttl_s=60)
        lat.append((time.perf_counter() - t0) * 1000)
        statuses[out.status] = statuses.get(out.status, 0) + 1
        time.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))
    lat.sort()
    return {
        "p50_ms": statistics.median(lat),
        "p99_ms": lat[int(0.99 * (len(lat) - 1))],
        "statuses": statuses,
    }


def run(n_pins: int, peers: int, d: Path) -> dict:
    (d / "secret").write_bytes(SECRET)
    (d / "policy.yaml").write_text(f"trust: {{secret_file: {d / 'secret'}}}\n")
    engine_id = new_engine_id()
    cfg = kv_transfer_config(
        engine_id,
        sessionkv={
            "policy_file": str(d / "policy.yaml"),
            "control": {"endpoint_file": str(d / "engine.json")},
        },
    )
    with ServerProcess(
        TINY,
        [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    ) as srv:
        try:
            requests.post(
                srv.url + "/v1/completions",
                timeout=120,
                json={
                    "model": TINY,
                    "prompt": "hello " * 200,
                    "max_tokens": 4,
                    "session_id": "flood-s",
                },
            ).raise_for_status()
            time.sleep(3)  # offloads finish, memory settles
            client = HintClient.from_endpoint_file(str(d / "engine.json"), SECRET)
            endpoint = client.endpoint
            with client:
                unloaded = pins(client, n_pins)
                rss_before = tree_rss_mib(srv.proc.pid)
                stop, counts = mp.Event(), mp.Manager().dict()
                attacker = mp.Process(target=flood, args=(endpoint, peers, stop, counts))
                attacker.start()
                peak, sampling = [rss_before], threading.Event()

                def sample() -> None:
                    while not sampling.wait(0.2):
                        peak.append(tree_rss_mib(srv.proc.pid))

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                time.sleep(2)  # the flood is under way
                loaded = pins(client, n_pins)
                stop.set()
                attacker.join(30)
                sampling.set()
                sampler.join()
                refused = client.status().get("control", {}).get("peers", {}).get("refused")
        finally:
            remove_offload_region(engine_id)
    out = {
        "peers": peers,
        "pins": n_pins,
        "unloaded": unloaded,
        "loaded": loaded,
        "p50_ratio": loaded["p50_ms"] / unloaded["p50_ms"],
        "rss_before_mib": rss_before,
        "rss_peak_mib": max(peak),
        "rss_growth_mib": max(peak) - rss_before,
        "flood_frames_queued": counts.get("frames", 0),
        "flood_tcp_bytes": counts.get("tcp_bytes", 0),
        "zap_refused": refused,
        "goals": GOALS,
    }
    out["ok"] = (
        out["rss_growth_mib"] <= GOALS["rss_growth_mib_max"]
        and out["p50_ratio"] <= GOALS["p50_ratio_max"]
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--pins", type=int, default=100)
    ap.add_argument("--peers", type=int, default=64)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        out = run(args.pins, args.peers, Path(d))
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
