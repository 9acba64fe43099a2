"""CPU an idle API server uses, with and without the control channel, and
with a hint copy in flight.

    python bench/idle_cpu.py --json OUT [--seconds 10]

Starts the tiny model's server three times, serves one request, lets it
settle, then counts the CPU seconds of the server's whole process tree over
``--seconds`` of idleness: policy with a secret (the channel and event stream
run); without one (they do not); and with the channel, G3 on a Redis of its
own (``write_through: false``) and a Demote of the request's session sent
over the channel while Redis holds every write (``CLIENT PAUSE WRITE``), so
the copy stays in flight through the window. An engine that stepped until
the copy ended would spin a core here. The Demote's final outcome is read
after Redis resumes: ``copy_final`` (``status`` ``accepted`` and the
``chunks`` it copied: the copy was real and in flight through the window). Keys: ``{"seconds", "with_channel_cpu_s",
"without_channel_cpu_s", "copy_in_flight_cpu_s", "copy_final", and
"<each>_cores"}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil
import requests

from sessionkv.client import HintClient
from sessionkv.devtools.engines import TINY, final_outcome, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region
from sessionkv.devtools.services import start_redis

SECRET = b"idle-bench-secret-0123456789"

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
    return tree_sum(pid, lambda p: sum(p.cpu_times()[:2]))  # user + system


def serve(policy: Path, control: dict | None = None, **extra):
    """The tiny model's server with ``policy`` (``control``: the channel's
    settings; ``extra``: more connector config), after one request of
    session ``idle`` and a few seconds to settle."""
    engine_id = new_engine_id()
    skv = {"policy_file": str(policy), **({"control": control} if control else {})}
    cfg = kv_transfer_config(engine_id, sessionkv=skv, **extra)
    srv = ServerProcess(
        TINY,
        [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        requests.post(
            srv.url + "/v1/completions",
            timeout=120,
            json={"model": TINY, "prompt": "hello " * 200, "max_tokens": 4, "session_id": "idle"},
        ).raise_for_status()
        time.sleep(5)  # offloads finish, timers settle
    except BaseException:
        srv.stop()
        remove_offload_region(engine_id)
        raise
    return srv, engine_id


def cpu_over(srv, seconds: float) -> float:
    before = tree_cpu_s(srv.proc.pid)
    time.sleep(seconds)
    return tree_cpu_s(srv.proc.pid) - before


def idle_cpu(policy: Path, seconds: float) -> float:
    srv, engine_id = serve(policy)
    try:
        return cpu_over(srv, seconds)
    finally:
        srv.stop()
        remove_offload_region(engine_id)


def copy_in_flight_cpu(d: Path, seconds: float) -> tuple[float, dict]:
    """Idle CPU while a Demote's copy to G3 waits for a paused Redis; the
    Demote's final outcome once Redis resumes."""
    import redis

    url, server = start_redis(d)
    policy = d / "copy.yaml"
    policy.write_text(f"trust: {{secret_file: {d / 'secret'}}}\ng3: {{write_through: false}}\n")
    tier = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": url,
        "timeout_s": 10 * seconds,
    }  # the held write is not abandoned meanwhile
    try:
        srv, engine_id = serve(
            policy, secondary_tiers=[tier], control={"endpoint_file": str(d / "copy.json")}
        )
        try:
            r = redis.Redis.from_url(url)
            r.execute_command("CLIENT", "PAUSE", int((seconds + 30) * 1000), "WRITE")
            endpoint = json.loads((d / "copy.json").read_text())["control"]
            with HintClient(endpoint, SECRET) as c:
                after = c.events(after=0, limit=1).next_seq - 1
                first = c.demote("idle")
                if first.status != "deferred":
                    raise RuntimeError(f"the Demote did not start a copy: {first}")
                time.sleep(1)  # the copy reached the held write
                cpu = cpu_over(srv, seconds)
                r.execute_command("CLIENT", "UNPAUSE")
                final, moved = final_outcome(c, first.hint_id, after)
            return cpu, {"status": final.status, "chunks": len(moved.keys) if moved else 0}
        finally:
            srv.stop()
            remove_offload_region(engine_id)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "secret").write_bytes(SECRET)
        (d / "with.yaml").write_text(f"trust: {{secret_file: {d / 'secret'}}}\n")
        (d / "without.yaml").write_text("version: 1\n")
        out = {
            "seconds": args.seconds,
            "with_channel_cpu_s": idle_cpu(d / "with.yaml", args.seconds),
            "without_channel_cpu_s": idle_cpu(d / "without.yaml", args.seconds),
        }
        out["copy_in_flight_cpu_s"], out["copy_final"] = copy_in_flight_cpu(d, args.seconds)
    for k in ("with_channel", "without_channel", "copy_in_flight"):
        out[f"{k}_cores"] = out[f"{k}_cpu_s"] / args.seconds
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
