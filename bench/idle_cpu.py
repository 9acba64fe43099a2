"""CPU an idle API server uses, with and without the control channel.

    python bench/idle_cpu.py --json OUT [--seconds 10]

Starts the tiny model's server twice (policy with a secret: the channel and
event stream run; without one: they do not), serves one request, lets it
settle, then counts the CPU seconds of the server's whole process tree over
``--seconds`` of idleness. Keys: ``{"seconds", "with_channel_cpu_s",
"without_channel_cpu_s", "with_channel_cores", "without_channel_cores"}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil
import requests


from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region

ARGS = ["--enforce-eager", "--block-size", "32", "--max-model-len", "1024", "--dtype", "float32"]


def tree_sum(pid: int, measure) -> float:
    """``measure(process)`` summed over a server's process tree (processes
    that end meanwhile count 0)."""
    total = 0.0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            total += measure(p)
        except psutil.NoSuchProcess:
            pass
    return total


def tree_cpu_s(pid: int) -> float:
    return tree_sum(pid, lambda p: sum(p.cpu_times()[:2]))     # user + system


def idle_cpu(policy: Path, seconds: float) -> float:
    engine_id = new_engine_id()
    cfg = kv_transfer_config(engine_id, sessionkv={"policy_file": str(policy)})
    with ServerProcess(TINY, [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as srv:
        try:
            requests.post(srv.url + "/v1/completions", timeout=120, json={
                "model": TINY, "prompt": "hello " * 50, "max_tokens": 4}).raise_for_status()
            time.sleep(5)                      # offloads finish, timers settle
            before = tree_cpu_s(srv.proc.pid)
            time.sleep(seconds)
            return tree_cpu_s(srv.proc.pid) - before
        finally:
            remove_offload_region(engine_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "secret").write_bytes(b"idle-bench-secret-0123456789")
        (d / "with.yaml").write_text(f"trust: {{secret_file: {d / 'secret'}}}\n")
        (d / "without.yaml").write_text("version: 1\n")
        out = {"seconds": args.seconds,
               "with_channel_cpu_s": idle_cpu(d / "with.yaml", args.seconds),
               "without_channel_cpu_s": idle_cpu(d / "without.yaml", args.seconds)}
    for k in ("with", "without"):
        out[f"{k}_channel_cores"] = out[f"{k}_channel_cpu_s"] / args.seconds
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
