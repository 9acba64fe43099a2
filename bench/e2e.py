"""End-to-end bench: a scaled-down slice of the Mooncake conversation trace
replayed through the router onto two real vLLM servers, in three modes.

    python bench/e2e.py --json OUT [--sessions 16] [--time-scale 0.05]

Workload: the multi-turn sessions of the trace's first ``--window`` requests
(up to ``--sessions`` of them, plus ``--singles`` one-turn sessions as
background traffic), in trace order. Every trace block (512 tokens, a chained
hash id) becomes ``--block-tokens`` token ids drawn from its id, so equal ids
mean equal prefixes, as in the trace; outputs are ``output_length / 16``
tokens (at most ``--max-out``). Request times are trace times x
``--time-scale``; a session's next turn waits for its previous one. Model:
``.cache/models/realistic`` (8 layers, hidden 768), float32, greedy.

Each engine's OpenMP threads run on half of the machine's cores (``core_halves``).

Modes (fresh engines and router each; G1 kept small with
``--num-gpu-blocks-override`` blocks of 32 tokens, so that sessions
compete for it):

- ``no_connector``: plain vLLM (G1 prefix caching only); the router routes by
  affinity and load;
- ``connector_no_hints``: SessionTierConnector with a G2 of ``--g2-mib`` per
  engine (LRU); the router sends no hints;
- ``connector_hints``: the same engines; the router Pins a session for the
  gap to its next turn (``X-Session-Tool-Gap``, what an agent framework knows
  when a turn ends in a tool call) and ends it after its last turn (frees).

Per mode: TTFT (streamed, time to the first token at the client) mean and
p90, and recomputed prompt tokens (prompt tokens minus those vLLM reports as
cached: G1 hits plus connector loads). ``outputs_equal``: every request's
tokens equal a serial cold reference (each prompt alone on a fresh cache
salt). No G3 here: the modes differ in what G1/G2 keep between turns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests

from replay_trace import load_trace

from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.router_process import RouterProcess
from sessionkv.devtools.server import ServerProcess, free_port, remove_offload_region
from sessionkv.devtools.services import start_redis

ROOT = Path(__file__).resolve().parents[1]

MODEL = str(MODELS / "realistic")
TRACE = "/work/shared/traces/mooncake/conversation_trace.jsonl"
MODES = ("no_connector", "connector_no_hints", "connector_hints")
SECRET = b"bench-e2e-secret-0123456789abcdef"


@dataclass(frozen=True)
class Req:
    i: int
    t: float                 # seconds from the start
    session: str
    turn: int
    prompt: list[int]
    max_tokens: int
    gap_s: float | None      # time to the session's next turn (None: its last)


def workload(args) -> list[Req]:
    tr = load_trace(TRACE, args.window)
    turns: dict[int, list[int]] = {}
    for i in range(len(tr)):
        turns.setdefault(tr.session[i], []).append(i)
    multi = [s for s, ix in turns.items() if len(ix) > 1][:args.sessions]
    singles = [s for s, ix in turns.items() if len(ix) == 1][:args.singles]
    keep = sorted(i for s in multi + singles for i in turns[s])
    t0 = tr.t[keep[0]]
    out = []
    for i in keep:
        ids = tr.blocks[i][:args.max_blocks]
        toks: list[int] = []
        for h in ids:
            toks += np.random.default_rng(h).integers(10, 4000, args.block_tokens).tolist()
        s = tr.session[i]
        later = [j for j in turns[s] if j > i]
        gap = (tr.t[later[0]] - tr.t[i]) * args.time_scale if later else None
        out.append(Req(len(out), (tr.t[i] - t0) * args.time_scale, f"s{s}", tr.turn[i], toks,
                       max(1, min(args.max_out, tr.output_length[i] // 16)), gap))
    return out


def core_halves() -> tuple[str, str]:
    """This machine's CPUs split in two, as ``VLLM_CPU_OMP_THREADS_BIND``
    lists: each engine's OpenMP threads get cores of their own. With both on
    every core (vLLM's ``auto``), the two engines' spinning OpenMP threads
    take turns on the same cores and a 300-token prefill waits seconds."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:] or cpus))


def engine(args, d: Path, name: str, connector: bool, cores: str = "auto") -> ServerProcess:
    """One server; with the connector, ``.engine_id`` names its G2 region."""
    cmd = ["--enforce-eager", "--dtype", "float32", "--seed", "0", "--block-size",
           "32", "--max-model-len", "1280", "--max-num-seqs", "8",
           "--num-gpu-blocks-override", str(args.g1_blocks), "--enable-prompt-tokens-details"]
    engine_id = None
    if connector:
        engine_id = f"bench-{uuid.uuid4().hex[:10]}"
        cfg = {"kv_connector": "SessionTierConnector",
               "kv_connector_module_path": "sessionkv.connectors.vllm", "kv_role": "kv_both",
               "engine_id": engine_id,
               "kv_connector_extra_config": {
                   "cpu_bytes_to_use": args.g2_mib << 20,
                   "sessionkv": {"policy_file": str(d / "tiers.yaml"),
                                 "control": {"endpoint_file": str(d / f"{name}.json")}}}}
        cmd += ["--kv-transfer-config", json.dumps(cfg)]
    srv = ServerProcess(MODEL, cmd, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                         "VLLM_CPU_KVCACHE_SPACE": "1",
                                         "VLLM_CPU_OMP_THREADS_BIND": cores})
    srv.engine_id = engine_id
    return srv


def start_router(d: Path, workers: list[dict], redis_url: str, hints: bool) -> RouterProcess:
    cfg = {"version": 1, "listen": {"host": "127.0.0.1", "port": free_port()},
           "secret_file": str(d / "secret"),
           "redis": {"url": redis_url, "namespace": f"bench-{uuid.uuid4().hex[:6]}"},
           "workers": workers, "routing": {"max_load": 6, "load_poll_s": 0.25},
           "policy": {"on_end": "free" if hints else "none",
                      "strategy": "auto" if hints else "plain",
                      "on_move": "share" if hints else "none",
                      "tool_call": {"pin": hints, "pin_ttl_factor": 1.5}}}
    return RouterProcess(cfg, d / f"router-{cfg['listen']['port']}.yaml")


def stream(url: str, body: dict, headers: dict) -> tuple[float, list[int], int, int]:
    """One streamed completion: (TTFT s, token ids, prompt tokens, cached tokens)."""
    t0 = time.monotonic()
    ttft, toks, usage = None, [], {}
    with requests.post(url + "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 0, "return_tokens_as_token_ids": True},
            headers=headers, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            doc = json.loads(line[6:])
            for ch in doc.get("choices") or ():
                got = (ch.get("logprobs") or {}).get("tokens") or []
                if got and ttft is None:
                    ttft = time.monotonic() - t0
                toks += [int(t.split(":")[1]) for t in got]
            if doc.get("usage"):
                usage = doc["usage"]
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ttft if ttft is not None else time.monotonic() - t0, toks, \
        usage.get("prompt_tokens", 0), cached


def replay(url: str, reqs: list[Req], hints: bool, model: str) -> dict[int, tuple]:
    """Every request at its time (a session's turn after its previous one);
    per request (ttft, tokens, prompt, cached)."""
    results: dict[int, tuple] = {}
    done = {r.i: threading.Event() for r in reqs}
    prev: dict[str, int] = {}
    order = {}
    for r in reqs:
        order[r.i] = prev.get(r.session)
        prev[r.session] = r.i
    t0 = time.monotonic()

    def one(r: Req) -> None:
        try:
            if order[r.i] is not None:
                done[order[r.i]].wait()
            time.sleep(max(0.0, t0 + r.t - time.monotonic()))
            headers = {"X-Session-ID": r.session}
            if hints and r.gap_s is not None:
                headers["X-Session-Tool-Gap"] = f"{max(r.gap_s, 0.5):.3f}"
            results[r.i] = stream(url, {"model": model, "prompt": r.prompt,
                                        "max_tokens": r.max_tokens, "temperature": 0,
                                        "ignore_eos": True}, headers)
            if hints and r.gap_s is None:
                requests.post(f"{url}/v1/sessions/{r.session}/end", timeout=60)
        except Exception as e:          # counted as an error, never as a fast request
            print(f"request {r.i} ({r.session} turn {r.turn}) failed: {e!r}", file=sys.stderr)
            results[r.i] = (float("nan"), None, 0, 0)
        finally:
            done[r.i].set()

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_mode(args, d: Path, mode: str, reqs: list[Req], redis_url: str) -> dict[int, tuple]:
    connector = mode != "no_connector"
    servers = []
    try:
        for name, cores in zip("ab", core_halves()):
            servers.append(engine(args, d, name, connector, cores))
        workers = [{"name": n, "url": s.url, **({"endpoint_file": str(d / f"{n}.json")}
                                               if connector else {"plain": True})}
                   for n, s in zip("ab", servers)]
        router = start_router(d, workers, redis_url, mode == "connector_hints")
        try:
            t = time.monotonic()
            res = replay(router.url, reqs, mode == "connector_hints", MODEL)
            print(f"{mode}: {len(res)}/{len(reqs)} requests in {time.monotonic() - t:.1f} s",
                  file=sys.stderr)
            status = requests.get(router.url + "/router/status", timeout=10).json()
            print(f"{mode}: router {json.dumps({k: status[k] for k in ('outcomes', 'events')})}",
                  file=sys.stderr)
            for s in servers:               # what the engines did with the hints
                text = requests.get(s.url + "/metrics", timeout=10).text
                print(f"{mode}: {s.url} " + "; ".join(
                    ln for ln in text.splitlines() if ln.startswith("sessionkv:hint_outcomes")),
                    file=sys.stderr)
            return res
        finally:
            router.stop()
    finally:
        for s in servers:
            s.stop()
            if s.engine_id:                 # its G2 region in /dev/shm
                remove_offload_region(s.engine_id)


def reference(args, d: Path, reqs: list[Req]) -> dict[int, list[int]]:
    """Each prompt alone, from scratch (a fresh cache salt), on a plain engine."""
    srv = engine(args, d, "ref", False)
    try:
        out = {}
        for r in reqs:
            out[r.i] = stream(srv.url, {"model": MODEL, "prompt": r.prompt,
                                        "max_tokens": r.max_tokens, "temperature": 0,
                                        "ignore_eos": True, "cache_salt": uuid.uuid4().hex},
                              {})[1]
        return out
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--window", type=int, default=1500)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--singles", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--max-out", type=int, default=16)
    ap.add_argument("--g1-blocks", type=int, default=48)
    # Small enough that G2 cannot keep every session between its turns (at
    # 192 MiB LRU kept them all in one of two runs): what hints are for.
    ap.add_argument("--g2-mib", type=int, default=96)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    reqs = workload(args)
    print(f"{len(reqs)} requests, {len({r.session for r in reqs})} sessions, "
          f"{sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{reqs[-1].t:.1f} s of trace time", file=sys.stderr)
    d = Path(tempfile.mkdtemp(prefix="sessionkv-bench-e2e-"))
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(
        "version: 1\nlimits: {pin_fraction_session: 1.0, pin_fraction_global: 0.9}\n"
        f"trust: {{secret_file: {d / 'secret'}}}\n")
    redis_url, redis = start_redis(d)
    results, out = {}, {"modes": {}}
    try:
        for mode in args.modes.split(","):
            res = results[mode] = run_mode(args, d, mode, reqs, redis_url)
            ttft = np.array([res[r.i][0] for r in reqs])
            out["modes"][mode] = {
                "ttft_mean_s": float(np.nanmean(ttft)),
                "ttft_p90_s": float(np.nanpercentile(ttft, 90)),
                "errors": int(np.isnan(ttft).sum()),
                "recomputed_tokens": int(sum(res[r.i][2] - res[r.i][3] for r in reqs)),
                "prompt_tokens": int(sum(res[r.i][2] for r in reqs))}
            print(json.dumps({mode: out["modes"][mode]}), file=sys.stderr)
        ref = reference(args, d, reqs)
        diff = [(m, r.i) for m, res in results.items() for r in reqs if res[r.i][1] != ref[r.i]]
        out["outputs_equal"] = not diff
        out["outputs_differing"] = diff[:20]
        out["requests"], out["args"] = len(reqs), vars(args)
    finally:
        redis.stop()
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
