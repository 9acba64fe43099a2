"""Agents end to end: closed-loop agent sessions on two real vLLM servers
through ``sessionkv router``, side by side with what users run instead, at
the same memory per tier.

    scripts/netns .venv/bin/python bench/agents.py --json OUT [--plot OUT.png]
        [--coding] [--modes plain,lru,lru+g3,sessionkv,oracle] [--runs 3] [--quick]

(``scripts/netns``: Mooncake's store listens on all interfaces.) Workloads
(``agents_workload.py``): the default (tasks of 3-5 turns, log-normal tool
calls, two shared documents) and ``--coding`` (12-20 turns over shared
repositories, heavy-tailed gaps, sub-agents, compactions). ``--agents``
agents run at once; each takes the next task when its task ends. Per turn
the client streams a completion through the router and tells it only what an
agent framework knows: ``X-Session-Tool-Gap: default`` when the turn ends in
a tool call (the random-weight model never emits ``tool_calls``, so the
header is the signal) and ``POST /v1/sessions/{id}/end`` when the task ends;
never a duration (except in ``oracle``).

Modes (fresh engines, router and G3 each; the same tasks):

- ``plain``: vLLM with its prefix cache (G1) only;
- ``lru``: SessionTierConnector with vLLM's LRU in G2 and no G3, the router
  sending no hints: vLLM's own CPU offloading as users run it;
- ``lru+g3``: ``lru`` plus the same Mooncake G3 as ``sessionkv``, written
  through: what users run without sessionkv;
- ``sessionkv``: the connector with G2 and G3 on Mooncake (written through),
  the router with its shipped defaults;
- ``oracle``: ``sessionkv`` plus a Pin for each tool call's true duration
  (x 1.25): a ceiling, not a mode to beat.

``mode@key=value@...`` overrides the router's policy keys (a diagnosis).
Each engine's OpenMP threads have one core of their own (``core_halves``).
Sizes per workload (``DEFAULT_SIZES``, ``CODING_SIZES``): G1 about one idle
agent's context next to a running turn, G2 about three quarters of an
engine's live working set, G3 (``--store``) below what a run writes. The
router moves a session whose worker carries ``--max-load`` requests.

Modes run interleaved (plain, lru, lru+g3, sessionkv, oracle, plain, ...),
``--runs`` rounds. Figures per run (``agents_workload.run_figures``):
resumed-turn TTFT p50/p90 (turns after a tool call; TTFT is the first
streamed token at the client) and its attribution (the router's part from
``X-SessionKV-Routed-S``; the engines' queue and prefill time from vLLM's
histograms; the scheduler's lock waits and the control thread's work from
sessionkv's metrics), task completion time, recomputed prefill tokens
(prompt tokens minus vLLM's ``cached_tokens``), prompt tokens per tier (the
engines' ``sessionkv:prompt_tokens``), bytes moved between tiers. Exactness:
every turn's tokens equal a cold run of its prompt alone (fresh cache salt)
on a plain engine; ``outputs_equal`` in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import requests
import yaml
from agents_workload import (
    Shape,
    Task,
    TurnResult,
    coding_shape,
    live_working_set,
    make_tasks,
    max_context,
    run_figures,
    summary,
    turn_record,
)
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from sessionkv.devtools.engines import MODELS, kv_transfer_config, new_engine_id
from sessionkv.devtools.router_process import RouterProcess
from sessionkv.devtools.server import ServerProcess, free_port, remove_offload_region
from sessionkv.devtools.services import lan_address, start_mooncake, start_redis
from sessionkv.router.app import ROUTED_HEADER
from sessionkv.router.hinting import TOOL_GAP_HEADER

MODEL = str(MODELS / "realistic")
MODES = ("plain", "lru", "lru+g3", "sessionkv", "oracle")
G3_MODES = ("lru+g3", "sessionkv", "oracle")  # with a Mooncake G3
HINTLESS = ("plain", "lru", "lru+g3")  # the router sends no hints
SECRET = b"bench-agents-secret-0123456789abcdef"
BLOCK = 32
KV_BYTES_PER_TOKEN = 8 * 2 * 768 * 4  # the realistic model: layers x (K, V) x hidden x fp32


def core_halves() -> tuple[str, str]:
    """This machine's CPUs split in two, as ``VLLM_CPU_OMP_THREADS_BIND``
    lists: each engine's OpenMP threads get cores of their own. With both on
    every core (vLLM's ``auto``), the two engines' spinning OpenMP threads
    take turns on the same cores and a 300-token prefill waits seconds."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:] or cpus))


def stream(url: str, body: dict, headers: dict) -> tuple[float, list[int], int, int, str, float]:
    """One streamed completion: (TTFT s, token ids, prompt tokens, cached
    tokens, the worker the router chose, the router's seconds before it
    forwarded the turn)."""
    t0 = time.monotonic()
    ttft, toks, usage = None, [], {}
    with requests.post(
        url + "/v1/completions",
        json={
            **body,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
        headers=headers,
        stream=True,
        timeout=600,
    ) as r:
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
        worker = r.headers.get("X-SessionKV-Worker", "")
        routed = float(r.headers.get(ROUTED_HEADER, 0.0))
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return (
        ttft if ttft is not None else time.monotonic() - t0,
        toks,
        usage.get("prompt_tokens", 0),
        cached,
        worker,
        routed,
    )


def parse_mode(spec: str) -> tuple[str, dict]:
    """``mode`` or ``mode@key=value@...``: a mode with router policy keys
    overridden (diagnostics: ``sessionkv@on_move=none``); values are YAML."""
    mode, *items = spec.split("@")
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    over = {}
    for item in items:
        k, _, v = item.partition("=")
        over[k] = yaml.safe_load(v)
    return mode, over


def engine(
    a, d: Path, name: str, mode: str, cores: str, mooncake=None, tag: str = ""
) -> ServerProcess:
    """One server for ``mode``; with the connector, ``.engine_id`` names its G2 region."""
    cmd = [
        "--enforce-eager",
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        str(a.max_model_len),
        "--max-num-seqs",
        "4",
        "--num-gpu-blocks-override",
        str(a.g1_blocks),
        "--enable-prompt-tokens-details",
    ]
    engine_id = None
    if mode != "plain":
        engine_id = new_engine_id()
        tiers = (
            []
            if mode not in G3_MODES
            else [
                {
                    "type": "MooncakeTier",
                    "module_path": "sessionkv.tiers.g3.backends.mooncake",
                    "master": mooncake.master,
                    "metadata_server": mooncake.metadata_url,
                    "local_hostname": lan_address(),
                    "namespace": f"agents-{tag}",
                    "timeout_s": 10.0,
                }
            ]
        )
        policy = d / ("lru.yaml" if mode in HINTLESS else "tiers.yaml")
        cfg = kv_transfer_config(
            engine_id,
            a.g2_mib << 20,
            secondary_tiers=tiers,
            sessionkv={
                "policy_file": str(policy),
                "control": {"endpoint_file": str(d / f"{name}.json")},
            },
        )
        cmd += ["--kv-transfer-config", json.dumps(cfg)]
    srv = ServerProcess(
        MODEL,
        cmd,
        env={
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cores,
        },
    )
    srv.engine_id = engine_id
    return srv


def write_policies(d: Path) -> None:
    (d / "secret").write_bytes(SECRET)
    trust = f"trust: {{secret_file: {d / 'secret'}}}\n"
    # The oracle's Pins may hold a whole session (a ceiling); sessionkv sends no Pins.
    (d / "tiers.yaml").write_text(
        "version: 1\nlimits: {pin_fraction_session: 1.0, pin_fraction_global: 0.9}\n" + trust
    )
    (d / "lru.yaml").write_text("version: 1\ng2: {eviction: lru}\n" + trust)


def router_config(
    a, d: Path, mode: str, workers: list[dict], redis_url: str, over: dict | None = None
) -> dict:
    policy: dict = {}  # sessionkv: the shipped defaults
    if mode in HINTLESS:
        policy = {"strategy": "plain", "on_end": "none", "on_move": "none"}
    elif mode == "oracle":
        policy = {"tool_call": {"pin": True, "pin_ttl_factor": 1.25}}
    policy.update(over or {})
    return {
        "version": 1,
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "secret_file": str(d / "secret"),
        "redis": {"url": redis_url, "namespace": f"agents-{uuid.uuid4().hex[:8]}"},
        "workers": workers,
        "routing": {"max_load": a.max_load},
        "policy": policy,
    }


def prompt_key(prompt: list[int], max_tokens: int) -> str:
    return hashlib.blake2b(repr((max_tokens, prompt)).encode(), digest_size=12).hexdigest()


class Agents:
    """``--agents`` threads taking tasks from one queue until none is left."""

    def __init__(self, url: str, mode: str, shape: Shape, tasks: list[Task], tag: str, agents: int):
        self.url, self.mode, self.shape, self.tag = url, mode, shape, tag
        self.todo: queue.Queue[Task] = queue.Queue()
        for t in tasks:
            self.todo.put(t)
        self.turns: list[TurnResult] = []
        self.prompts: dict[str, list[int]] = {}  # prompt_key -> prompt, for the reference
        self.task_s: list[float] = []
        self.doc_workers: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._agent, daemon=True) for _ in range(agents)]

    def run(self, bar: tqdm) -> None:
        self.bar = bar
        for t in self.threads:
            t.start()
        for t in self.threads:
            t.join()

    def _agent(self) -> None:
        while True:
            try:
                task = self.todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.monotonic()
            self._task(task)
            with self._lock:
                self.task_s.append(time.monotonic() - t0)
            self.bar.update(1)

    def _task(self, task: Task) -> None:
        session = f"agent-{self.tag}-{task.i}"
        self._session(task, session, list(task.head), 0)
        requests.post(f"{self.url}/v1/sessions/{session}/end", timeout=60)

    def _session(
        self, task: Task, session: str, prompt: list[int], prefix: int, sub: bool = False
    ) -> list[int] | None:
        """``task``'s turns as ``session``, from ``prompt`` (``prefix``: of it,
        what an earlier turn computed). Its last output; None after an error."""
        prev_worker, toks = None, []
        for k in range(task.turns):
            headers = {"X-Session-ID": session}
            if k < len(task.tools):
                gap = task.tools[k]
                if k == task.sub_at and task.sub is not None:
                    gap = sum(task.sub.tools)  # the oracle's guess: the sub-agent's tools
                headers[TOOL_GAP_HEADER] = f"{gap:.3f}" if self.mode == "oracle" else "default"
            body = {
                "model": MODEL,
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": self.shape.output_tokens,
                "ignore_eos": True,
            }
            try:
                ttft, toks, n_prompt, cached, worker, routed = stream(self.url, body, headers)
                error = None if len(toks) == self.shape.output_tokens else "short output"
            except Exception as e:  # counted as an error, never as a fast turn
                ttft, toks, n_prompt, cached, worker, error = 0.0, [], len(prompt), 0, "", repr(e)
                routed = 0.0
            key = prompt_key(prompt, self.shape.output_tokens)
            r = TurnResult(
                task.i,
                k,
                ttft,
                n_prompt,
                cached,
                worker,
                moved=k > 0 and worker != prev_worker,
                prefix_tokens=prefix,
                output=toks,
                prompt_key=key,
                error=error,
                routed_s=routed,
                sub=sub,
            )
            if k == 0 and task.doc is not None and not sub:
                with self._lock:
                    seen = self.doc_workers.setdefault(task.doc, set())
                    r.cross_start = bool(seen) and worker not in seen
                    r.doc_tokens = self.shape.doc_tokens
                    seen.add(worker)
            with self._lock:
                self.turns.append(r)
                self.prompts[key] = prompt
            if error is not None:
                print(
                    f"{self.mode}: task {task.i} turn {k}{' (sub-agent)' if sub else ''}: {error}",
                    file=sys.stderr,
                )
                return None
            prev_worker, prefix = worker, len(prompt)
            if k == len(task.tools):
                break
            report: list[int] = []
            if k == task.sub_at and task.sub is not None:  # the tool call is a sub-agent
                branch = prompt + toks
                got = self._session(
                    task.sub, session + ".sub", branch + list(task.sub.head), len(branch), sub=True
                )
                requests.post(f"{self.url}/v1/sessions/{session}.sub/end", timeout=60)
                if got is None:
                    return None
                report = got
            else:
                time.sleep(task.tools[k])
            if k in task.compact_after:  # restarts from the document and a summary
                prompt = (
                    list(task.head[: task.doc_tokens])
                    + list(task.summaries[task.compact_after.index(k)])
                    + list(task.results[k])
                )
                prefix = task.doc_tokens
            else:
                prompt = prompt + toks + report + list(task.results[k])
        return toks


# vLLM's per-request histograms: a request's time from arrival to its first
# scheduling (waiting behind other requests, and for the connector's loads),
# and from then to its first token (prefill, the G1/G2 copies of that step).
ENGINE_TIMES = {
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:time_to_first_token_seconds": "ttft",
}


def engine_counts(url: str) -> Counter:
    """An engine's counters the figures use, flat: ``tokens.<source>``
    (``sessionkv:prompt_tokens``), ``moved_bytes.<src>><dst>``,
    ``<queue|prefill|ttft>_s`` / ``.._n`` (vLLM's histograms' sum and count),
    ``lock_wait_s`` (the scheduler's waits for the lock) and ``control_s.<op>``
    (the control thread's work)."""
    out: Counter = Counter()
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if fam.name == "sessionkv:prompt_tokens" and s.name.endswith("_total"):
                out["tokens." + s.labels.get("source", "?")] += s.value
            elif fam.name == "sessionkv:moved_bytes" and s.name.endswith("_total"):
                out[f"moved_bytes.{s.labels.get('src')}>{s.labels.get('dst')}"] += s.value
            elif fam.name == "sessionkv:lock_wait_seconds" and s.name.endswith("_total"):
                out["lock_wait_s"] += s.value
            elif fam.name == "sessionkv:control_seconds" and s.name.endswith("_total"):
                out["control_s." + s.labels.get("op", "?")] += s.value
            elif fam.name in ENGINE_TIMES and s.name.endswith(("_sum", "_count")):
                out[ENGINE_TIMES[fam.name] + ("_s" if s.name.endswith("_sum") else "_n")] += s.value
    return out


def start_engines(a, d: Path, mode: str, mooncake, tag: str) -> list[ServerProcess]:
    """Both engines, started side by side (each on its own core)."""
    got: dict[str, ServerProcess | BaseException] = {}

    def one(name: str, cores: str) -> None:
        try:
            got[name] = engine(a, d, name, mode, cores, mooncake, tag)
        except BaseException as e:
            got[name] = e

    threads = [threading.Thread(target=one, args=nc) for nc in zip("ab", core_halves())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    servers = [got[n] for n in "ab"]
    failed = [s for s in servers if isinstance(s, BaseException)]
    if failed:
        for s in servers:
            if isinstance(s, ServerProcess):
                stop_engine(s)
        raise failed[0]
    for s in servers:  # a fresh engine's first request pays one-off set-up (seconds)
        stream(
            s.url,
            {
                "model": MODEL,
                "prompt": list(range(10, 10 + 2 * BLOCK)),
                "max_tokens": 2,
                "cache_salt": "warm-up",
            },
            {},
        )
    return servers


def stop_engine(s: ServerProcess) -> None:
    s.stop()
    if s.engine_id:  # its G2 region in /dev/shm
        remove_offload_region(s.engine_id)


def run_once(
    a, d: Path, spec: str, shape: Shape, tasks: list[Task], redis_url: str, rnd: int
) -> tuple[dict, Agents]:
    mode, over = parse_mode(spec)
    tag = f"{mode.replace('+', '')}{rnd}-{uuid.uuid4().hex[:6]}"
    mooncake = None
    if mode in G3_MODES:
        mooncake = start_mooncake(d, store_size=a.store)
    try:
        servers = start_engines(a, d, mode, mooncake and mooncake[0], tag)
        try:
            before = [engine_counts(s.url) for s in servers]  # the warm-up requests
            workers = [
                {
                    "name": n,
                    "url": s.url,
                    **(
                        {"plain": True}
                        if mode == "plain"
                        else {"endpoint_file": str(d / f"{n}.json")}
                    ),
                }
                for n, s in zip("ab", servers)
            ]
            cfg = router_config(a, d, mode, workers, redis_url, over)
            router = RouterProcess(cfg, d / f"router-{tag}.yaml")
            try:
                t0 = time.monotonic()
                agents = Agents(router.url, mode, shape, tasks, tag, a.agents)
                with tqdm(
                    total=len(tasks),
                    desc=f"round {rnd + 1} {spec}",
                    unit="task",
                    file=sys.stderr,
                    mininterval=5,
                ) as bar:
                    agents.run(bar)
                wall = time.monotonic() - t0
                status = router.status()
            finally:
                router.stop()
            counts: Counter = Counter()
            for s, b in zip(servers, before):
                counts.update(engine_counts(s.url))
                counts.subtract(b)
        finally:
            for s in servers:
                stop_engine(s)
    finally:
        if mooncake:
            mooncake[2].stop()
            mooncake[1].stop()
    fig = run_figures(agents.turns, agents.task_s)
    fig.update(
        mode=spec,
        round=rnd,
        wall_s=wall,
        prompt_tokens_by_source={k[7:]: v for k, v in counts.items() if k.startswith("tokens.")},
        moved_bytes={k[12:]: v for k, v in counts.items() if k.startswith("moved_bytes.")},
        engine_s_per_request={
            k: counts[k + "_s"] / counts[k + "_n"]
            for k in ENGINE_TIMES.values()
            if counts[k + "_n"]
        },
        # Both engines, the whole run: the scheduler's waits for the
        # lock, and the control thread's work by op (hints, ends, copies).
        engine_s_total={
            "lock_wait": counts["lock_wait_s"],
            **{k[10:]: v for k, v in counts.items() if k.startswith("control_s.")},
        },
        hints_sent=status.get("hints_sent", {}),
        router_events={
            k: status["events"].get(k, 0)
            for k in ("moves", "sessions_new", "ended_api", "overlap_scored")
        },
        hint_outcomes=status.get("outcomes", {}),
        turn_records=[
            turn_record(t) for t in sorted(agents.turns, key=lambda t: (t.task, t.sub, t.turn))
        ],
    )
    print(
        f"{spec} round {rnd + 1}: "
        + json.dumps(
            {
                k: fig[k]
                for k in (
                    "resumed_ttft_p50_s",
                    "task_s_p50",
                    "recomputed_tokens",
                    "prefix_recomputed_tokens",
                    "cross_starts",
                    "moved_turns",
                    "moved_prefix_recomputed_fraction",
                    "errors",
                )
            }
        ),
        file=sys.stderr,
    )
    return fig, agents


def reference(a, d: Path, wanted: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Each distinct prompt alone from scratch (a fresh cache salt) on a plain
    engine; two engines, one per core, split the prompts."""
    servers = start_engines(a, d, "plain", None, "ref")
    keys = sorted(wanted)
    out: dict[str, list[int]] = {}
    try:

        def part(srv: ServerProcess, ks: list[str]) -> None:
            for k in ks:
                out[k] = stream(
                    srv.url,
                    {
                        "model": MODEL,
                        "prompt": wanted[k],
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "cache_salt": uuid.uuid4().hex,
                    },
                    {},
                )[1]

        threads = [
            threading.Thread(target=part, args=(s, keys[i::2])) for i, s in enumerate(servers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in servers:
            stop_engine(s)
    return out


def plot(
    per_mode: dict[str, list[dict]], turns: dict[str, list[list[TurnResult]]], path: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for mode, runs in turns.items():
        xs = np.sort([t.ttft_s for run in runs for t in run if t.turn > 0 and t.error is None])
        if len(xs):
            ax1.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=mode)
    ax1.set(
        xscale="log",
        xlabel="resumed-turn TTFT (s, log)",
        ylabel="fraction of turns",
        title="Resumed turns: TTFT CDF (all runs)",
    )
    ax1.legend()
    modes = list(per_mode)
    for ax, key, label in (
        (ax2, "recomputed_tokens", "recomputed prefill tokens per run"),
        (ax3, "task_s_p50", "task completion time p50 (s)"),
    ):
        vals = [[r[key] for r in per_mode[m] if r.get(key) is not None] for m in modes]
        med = [float(np.median(v)) if v else 0.0 for v in vals]
        lo = [m - (min(v) if v else 0) for m, v in zip(med, vals)]
        hi = [(max(v) if v else 0) - m for m, v in zip(med, vals)]
        ax.bar(modes, med, yerr=[lo, hi], capsize=4, color="tab:blue")
        ax.set(ylabel=label, title=label + "\n(median, bars: min-max over runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# Per workload: G1 about one idle agent's context beside a running turn (the
# coding workload's contexts outgrow it), G2 about three quarters of an
# engine's live working set, G3 about half of what a run writes to it.
DEFAULT_SIZES = {"g1_blocks": 68, "g2_mib": 112, "max_model_len": 2048, "store": "384MB"}
CODING_SIZES = {"g1_blocks": 176, "g2_mib": 256, "max_model_len": 4864, "store": "1GB"}


def quick_args(a) -> Shape:
    """``--quick``: a few minutes, the same paths (one round, small tasks)."""
    a.runs, a.agents = 1, 4
    a.g1_blocks, a.g2_mib, a.max_model_len, a.store = 24, 36, 640, "512MB"
    return Shape(
        tasks=6,
        docs=1,
        doc_tokens=256,
        task_tokens=128,
        turns=(2, 3),
        tool_tokens=(32, 96),
        output_tokens=8,
        tool_median_s=0.5,
        tool_sigma=0.5,
        tool_max_s=2.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--coding",
        action="store_true",
        help="the agentic coding workload (agents_workload.coding_shape) and its sizes",
    )
    ap.add_argument("--tasks", type=int)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--g1-blocks", type=int)
    ap.add_argument("--g2-mib", type=int)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-load", type=int, default=2)
    ap.add_argument("--store", help="the Mooncake store (G3) per run: below what a run writes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tool-median-s", type=float, help="the tool calls' median duration (log-normal)"
    )
    a = ap.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so that every finally stops its servers
    # (each runs in a process group of its own and would outlive the bench).
    signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
    if a.quick:
        shape = quick_args(a)
    else:
        shape = coding_shape(a.seed) if a.coding else Shape(seed=a.seed)
        shape = dataclasses.replace(
            shape,
            **{
                k: v
                for k, v in (("tasks", a.tasks), ("tool_median_s", a.tool_median_s))
                if v is not None
            },
        )
    for k, v in (CODING_SIZES if a.coding else DEFAULT_SIZES).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    tasks = make_tasks(shape)
    if a.max_model_len < max_context(shape, tasks):
        raise SystemExit(
            f"--max-model-len {a.max_model_len} < the longest context {max_context(shape, tasks)}"
        )
    block_mib = BLOCK * KV_BYTES_PER_TOKEN / 2**20
    live = live_working_set(tasks, shape, max(1, a.agents // 2), BLOCK)  # per engine
    sizes = {
        "g1_blocks": a.g1_blocks,
        "g2_blocks": int(a.g2_mib / block_mib),
        "block_mib": block_mib,
        "live_working_set_blocks_per_engine": round(live, 1),
        "g2_fraction_of_live": round(a.g2_mib / block_mib / live, 2),
        "store": a.store,
        "tasks": len(tasks),
        "turns": sum(t.turns + (t.sub.turns if t.sub else 0) for t in tasks),
        "tool_s_total": round(sum(sum(t.tools) for t in tasks), 1),
    }
    print("sizes: " + json.dumps(sizes), file=sys.stderr)
    modes = a.modes.split(",")
    d = Path(tempfile.mkdtemp(prefix="sessionkv-bench-agents-"))
    write_policies(d)
    redis_url, redis = start_redis(d)
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    turns: dict[str, list[list[TurnResult]]] = {m: [] for m in modes}
    prompts: dict[str, list[int]] = {}
    t_start = time.monotonic()
    try:
        for rnd in range(a.runs):
            for mode in modes:
                fig, agents = run_once(a, d, mode, shape, tasks, redis_url, rnd)
                per_mode[mode].append(fig)
                turns[mode].append(agents.turns)
                prompts.update(agents.prompts)
        ref = reference(a, d, prompts, shape.output_tokens)
    finally:
        redis.stop()
    differing = [
        (m, i, t.task, t.turn)
        for m, runs in turns.items()
        for i, run in enumerate(runs)
        for t in run
        if t.error is None and ref.get(t.prompt_key) != t.output
    ]
    out = {
        "summary": summary(per_mode),
        "outputs_equal": not differing
        and all(r["errors"] == 0 for runs in per_mode.values() for r in runs),
        "outputs_differing": differing[:20],
        "sizes": sizes,
        "runs": per_mode,
        "shape": dataclasses.asdict(shape),
        "args": {k: v for k, v in vars(a).items()},
        "wall_s": time.monotonic() - t_start,
    }
    Path(a.json).write_text(json.dumps(out, indent=2))
    if a.plot:
        plot(per_mode, turns, a.plot)
    print(json.dumps({"summary": out["summary"], "outputs_equal": out["outputs_equal"]}, indent=2))


if __name__ == "__main__":
    main()
