"""G3 write-through against a slow G3: the cascade queue, G2 held by it and
the cascades dropped, with sessionkv's default backpressure and without.

    .venv/bin/python bench/g3_backpressure.py --json OUT [--seconds 20] [--g2-chunks 262144]

A real vLLM ``Scheduler`` with SessionTierConnector (no model:
``scale_steps.make_scheduler``; one token a step, every G1 <-> G2 job
reported done in the next step) over a real Redis G3 tier (a redis-server of
its own), written through. Every step a new session's request arrives
(``--prompt-chunks`` chunks of prompt, 2 tokens out), for ``--seconds``.
The slow G3 is real Redis made slow: a thread holds every write with
``CLIENT PAUSE WRITE`` for ``--pause-ms`` of every ``--period-ms``, so puts
get through only in the gaps (here about 20-40 cascades a second, fewer than
arrive). Then the pauses stop and the queue drains.

Modes (a fresh scheduler, tier and namespace each):

- ``default``: no ``backpressure`` given: ``CascadeQueue`` at its default, an
  eighth of G2 (at least one backend call, 64 MiB: past that here);
- ``unbounded``: ``CascadeQueue`` with no limit (``max_chunks`` 2**40): what
  ran before the default, every cascade queued.

(vLLM's ``EMABackpressureDetector`` is not compared here: it works in
seconds per MiB, and this scheduler's chunks are 4 KiB, so a wait of a few
milliseconds reads as pressure. tests/connectors/test_g3_backpressure.py
shows it queueing every cascade of a stall.)

Per mode (JSON ``modes``): every ``--sample-s``, the queue in chunks and
jobs (vLLM's ``primary_read_usage_perc`` x G2 chunks,
``active_cascade_jobs``), cascades and chunks dropped so far, and G1 -> G2
stores refused for want of G2 room (vLLM's ``allocation_failure``); the
peaks; chunks in G3 at the end and the seconds the queue took to drain.
The memory the queue holds is G2: a queued cascade's chunks stay in their
G2 slots (read in place, no copy) until it ends. A chunk here is 4 KiB
(the scheduler moves no KV); in a deployment it is its chunk size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import redis
import scale_steps as steps
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.request import Request

from sessionkv.connectors.vllm import SessionTierConnector
from sessionkv.devtools.services import start_redis
from sessionkv.tiers.g3.backpressure import CascadeQueue
from sessionkv.types import Tier

TIER = ("1:RedisTier",)
PREFIX = "vllm:kv_offload_tiering_"
MODES = {
    "default": None,
    "unbounded": {
        "backpressure_cls": f"{CascadeQueue.__module__}.{CascadeQueue.__name__}",
        "max_chunks": 1 << 40,
    },
}


class RecordingConnector(SessionTierConnector):
    """Ours, adding up what vLLM's scheduler takes of the stats each step:
    the G3 tier's counters since start, its gauges as last set."""

    seen: dict[str, float] = {}

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if stats is not None:
            kinds = stats.data["types"]
            for name, values in stats.data["data"].items():
                value = values.get(TIER, values.get(()))
                if not isinstance(value, (int, float)):
                    continue
                if kinds[name] == "counter":
                    self.seen[name] = self.seen.get(name, 0) + value
                else:
                    self.seen[name] = value
        return stats


class Pulses(threading.Thread):
    """Redis holds every write ``pause_ms`` of every ``period_ms``."""

    def __init__(self, url: str, pause_ms: int, period_ms: int):
        super().__init__(daemon=True)
        self._r = redis.Redis.from_url(url)
        self._pause, self._period = pause_ms, period_ms
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self._r.execute_command("CLIENT", "PAUSE", self._pause, "WRITE")
            self.stop.wait(self._period / 1000)
        self._r.execute_command("CLIENT", "UNPAUSE")


def request(i: int, chunks: int) -> Request:
    base = 1 + i * (chunks * steps.BLOCK + 8)
    req = steps.session_request(
        f"r{i}", [(base + t) % 1_000_000 + 1 for t in range(chunks * steps.BLOCK + 3)], f"s{i}", 2
    )
    return req


def seen(name: str) -> float:
    return RecordingConnector.seen.get(name, 0)


def run_mode(mode: str, url: str, args) -> dict:
    init_none_hash(sha256)
    RecordingConnector.seen = {}
    tier = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": url,
        "namespace": f"bp-{mode}-{time.monotonic_ns()}",
        "timeout_s": 10.0,
    }
    if MODES[mode] is not None:
        tier["backpressure"] = MODES[mode]
    spec = steps.StepSpec(
        context=args.prompt_chunks * steps.BLOCK, running=8, g2_chunks=args.g2_chunks
    )
    sched = steps.make_scheduler(
        True,
        spec,
        connector=(RecordingConnector.__name__, __name__),
        extra_config={"secondary_tiers": [tier]},
    )
    (g3,) = sched.connector.manager.secondary_tiers
    pulses = Pulses(url, args.pause_ms, args.period_ms)
    pending: set[int] = set()
    samples, i = [], 0

    def step():
        nonlocal pending
        out = sched.schedule()
        meta = out.kv_connector_metadata
        sched.update_from_output(out, steps.model_output(out, pending))
        pending = set(getattr(meta, "load_jobs", ())) | set(getattr(meta, "store_jobs", ()))

    def sample(t):
        samples.append(
            {
                "t": round(t, 2),
                "queue_chunks": round(seen(PREFIX + "primary_read_usage_perc") * args.g2_chunks),
                "queue_jobs": seen(PREFIX + "active_cascade_jobs"),
                "dropped_chunks": seen(PREFIX + "backpressure_blocks_dropped"),
                "dropped_cascades": seen(PREFIX + "backpressure_stores_dropped"),
                "g2_refused": seen("vllm:kv_offload_allocation_failure"),
            }
        )

    try:
        pulses.start()
        t0 = next_sample = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            sched.add_request(request(i, args.prompt_chunks))
            i += 1
            step()
            time.sleep(args.step_s)
            if time.monotonic() >= next_sample:
                sample(time.monotonic() - t0)
                next_sample += args.sample_s
        sample(time.monotonic() - t0)
        pulses.stop.set()
        pulses.join()
        t1 = time.monotonic()
        while sched.has_requests() or pending:
            step()
            time.sleep(0.01)
            assert time.monotonic() - t1 < 300, "the queue did not drain"
        drained = time.monotonic() - t1
        sample(time.monotonic() - t0)
        manager = sched.connector.manager
        with manager.lock:
            in_g3 = sum(
                len(manager.index.resolve_session(f"s{j}").per_tier[Tier.G3]) for j in range(i)
            )
        return {
            "mode": mode,
            "detector": type(g3.bp_detector).__name__,
            "max_chunks": getattr(g3.bp_detector, "max_chunks", None),
            "requests": i,
            "offered_chunks": i * args.prompt_chunks,
            "peak_queue_chunks": max(s["queue_chunks"] for s in samples),
            "peak_queue_jobs": max(s["queue_jobs"] for s in samples),
            "dropped_chunks": samples[-1]["dropped_chunks"],
            "in_g3_chunks": in_g3,
            "g2_refused": samples[-1]["g2_refused"],
            "drain_s": round(drained, 2),
            "samples": samples,
        }
    finally:
        pulses.stop.set()
        sched.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--g2-chunks", type=int, default=262144)
    p.add_argument("--prompt-chunks", type=int, default=64)
    p.add_argument("--pause-ms", type=int, default=90)
    p.add_argument("--period-ms", type=int, default=100)
    p.add_argument("--step-s", type=float, default=0.005)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        url, server = start_redis(Path(d))
        try:
            modes = []
            for mode in args.modes.split(","):
                r = run_mode(mode, url, args)
                modes.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
        finally:
            server.stop()
    Path(args.json).write_text(json.dumps({"args": vars(args), "modes": modes}, indent=1))


if __name__ == "__main__":
    main()
