"""Production sizes: the scheduler side's cost per step, per eviction, per
expiry and per status, against targets.

    python bench/scale.py --json OUT [--quick]

Everything runs the product's classes in one process (no model):

- ``steps``: a real vLLM ``Scheduler`` with our connector and, on the same
  schedule, with vLLM's ``OffloadingConnector`` and its LRU policy
  (``scale_steps``): 256 running requests of 64k-token prompts at block size
  16, and of 4k-token prompts, both with G2 of 262,144 chunks, full when
  decoding starts (``step_spec``: at 4k, 1,029 earlier requests fill it
  first), so that decode stores evict in both and the two runs differ in
  context length alone. Until 2026-12-07 the 4k run had a G2 of 16,384
  chunks (a quarter of its blocks), so the ratio also compared a 16 x
  smaller G2, whose policy and index fit the caches. Our extra work per
  step is the difference of the two connectors' scheduler-side *work* at
  each step: their time less that of vLLM's code which both run alike
  (``scale_steps``' docstring: without it, vLLM's connector against itself
  differed by 1.2-2.9 ms at p99, more than the target), over
  ``DECODE_STEPS`` decode steps, each side's fastest of ``REPEATS`` runs of
  the deterministic schedule (``run_both``, which alternates which of the
  two steps first).
  ``extra_of_totals`` keeps the plain difference, and ``noise_floor_64k``
  both differences of vLLM's connector against itself (one run). Prompt
  lengths are drawn, so a decode step fills about 16 blocks at both lengths,
  as traffic would.
- ``evict``: ``SessionCachePolicy.evict(1)`` (and the insert that follows, as
  a store does) with all 262,144 chunks retained at mixed priorities, against
  vLLM's ``LRUCachePolicy`` with none; p99 of each, in one run.
- ``expiry``: the tier manager built by that scheduler (index, hint executor,
  G2 policy) with 10,000 live sessions and 16,384 live pins, 1,000 of the
  sessions idle past the timeout: ``expire_sessions`` as the connector calls
  it, at most ``EXPIRE_PER_PASS`` sessions and released chunks per scheduler
  pass, until none is left; the worst pass and the total.
- ``status``: the control channel's ``status`` op (``manager.service.status()``)
  with those 10,000 sessions: its longest hold of the lock (it summarizes
  the 1,000 it shows in batches, letting the lock go in between) and its
  total time.
- ``lines_4k``: the Python lines a 4k decode step runs in each connector's
  work (our packages and vLLM's offloading managers and policies; not the
  connector code both run alike, nor the scheduler), counted by a trace
  function over 16 decode steps of the same schedule. No target: unlike a
  time it comes out the same on every run and machine, so a change of a few
  percent shows (times here move 20 % from run to run), and ``top`` says
  which functions the extra lines are in.
- ``hint_holds`` (issue 52): every hold of the tier manager's lock from a
  16,384-chunk Share, Prefetch and Pin's arrival to its final outcome, at
  the production G2 size over a ``DiskTier`` (``bench/scale_holds.py``):
  the longest, and the longest after the first (the first hold is the
  executor's: resolution and, for a Pin, the G2 side; the others are the
  Mover's waves, at most ``moves.SLICE_CHUNKS`` chunks each); with one
  slice as large as the copy (the Mover before slices) for comparison.
  Reported, no target: a hold is bounded by its chunk count, and its time
  here includes the interpreter's own pauses (the longest copy hold of a
  run is several times its median).
- ``pin_memory`` (issue 52): peak engine-process memory (RSS and
  ``tracemalloc``) of a G3 Pin of a 6,250-chunk session on the disk tier
  against idle (``bench/pin_memory.py``, which runs alone, Mooncake too).
- ``soak``: 24 simulated hours of 10,000 live sessions taking turns (200 a
  minute, 32 new blocks each) over the same production G2 with write-through:
  the index's nodes and the process RSS each hour; sessions end or idle out.

Targets (issue 26): extra work per decode step p99 <= 0.5 ms and its ratio
64k / 4k <= 1.2; evict p99 <= 2 x LRU's; expiry <= 5 ms per pass; status's
longest hold of the lock <= 5 ms; from hour 2 to hour 24 of the soak the
index's nodes and the RSS grow by at most 5 %, and the nodes stay within what
is resident (G2 and the G3 copies known) plus one frontier per session.
The JSON holds each figure next to its target and ``targets_met``.
``--quick`` runs smaller sizes (a smoke run; its figures are not the targets').
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import vllm.v1.kv_offload
from replay_router import make_hint
from scale_steps import BLOCK, StepSpec, make_scheduler, run_both, step_times
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

import sessionkv
import sessionkv.index
import sessionkv.tiers
from sessionkv import connectors
from sessionkv.connectors.vllm import EXPIRE_PER_PASS
from sessionkv.hints import Action
from sessionkv.tiers import compat
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.tiers.g2.tier import G3_KNOWN_PER_G2_CHUNK
from sessionkv.types import Tier

G2_CHUNKS = 262_144
REPEATS = 5  # runs of each steps schedule; a step keeps its fastest
DECODE_STEPS = 256  # a p99 of 128 fell between their 2nd- and 3rd-largest steps


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else 0.0


def ms(x: float) -> float:
    return round(x * 1e3, 4)


def summary(xs: list[float]) -> dict:
    return {
        "p50_ms": ms(pct(xs, 50)),
        "p99_ms": ms(pct(xs, 99)),
        "max_ms": ms(max(xs) if xs else 0.0),
        "mean_ms": ms(sum(xs) / len(xs) if xs else 0.0),
        "steps": len(xs),
    }


# ---- steps ------------------------------------------------------------------


def step_spec(context: int, running: int, g2_chunks: int, decode_steps: int) -> StepSpec:
    """The schedule at ``context`` tokens with G2 of ``g2_chunks``, full before
    the measured requests decode: where their prompts would not fill it (at 4k
    256 x 255 blocks against 262,144 chunks), earlier requests of the same
    length fill it first, as a running engine's traffic has (their blocks
    are what decode steps then evict)."""
    blocks = context // BLOCK - 1  # full blocks of the shortest prompt
    warm = 0 if running * blocks >= g2_chunks else -(-g2_chunks // blocks)
    return StepSpec(
        context=context,
        running=running,
        g2_chunks=g2_chunks,
        decode_steps=decode_steps,
        warm_requests=warm,
    )


def steps(spec: StepSpec, repeats: int, same: bool = False) -> dict:
    """Ours minus vLLM's per step, per phase, on one schedule (``same``:
    vLLM's against itself)."""
    base, ours = run_both(spec, repeats, same)
    out = {
        "context": spec.context,
        "running": spec.running,
        "g2_chunks": spec.g2_chunks,
        "repeats": repeats,
    }
    for phase in ("prefill", "decode", "finish"):
        a, b = base[phase], ours[phase]
        if len(a["total"]) != len(b["total"]):
            raise RuntimeError(
                f"{phase}: the schedules differ ({len(a['total'])} vs {len(b['total'])} steps)"
            )
        out[phase] = {
            "vllm": summary(a["total"]),
            "ours": summary(b["total"]),
            "vllm_work": summary(a["work"]),
            "ours_work": summary(b["work"]),
            # The figure: works' difference (vLLM's shared code left out of both).
            "extra": summary([y - x for x, y in zip(a["work"], b["work"])]),
            "extra_of_totals": summary([y - x for x, y in zip(a["total"], b["total"])]),
        }
    return out


# ---- lines -------------------------------------------------------------------

# Where a connector's work runs: our packages, and vLLM's offloading managers
# and policies (its manager is the baseline's work). Not vLLM's connector code,
# which both run alike, nor its scheduler.
WORK_DIRS = tuple(
    str(Path(m.__file__).parent) + "/"
    for m in (sessionkv, connectors, sessionkv.index, sessionkv.tiers, vllm.v1.kv_offload)
)


def lines_per_step(spec: StepSpec, traced: int = 16, skip: int = 8) -> dict:
    """Python lines per decode step in each side's work (``WORK_DIRS``) over
    ``traced`` decode steps after ``skip``; ``top``: the functions with the
    most extra lines a step (ours less vLLM's)."""
    per_side = []
    for ours in (False, True):
        counts: Counter = Counter()

        def tracer(frame, event, arg, counts=counts):
            code = frame.f_code
            if not code.co_filename.startswith(WORK_DIRS):
                return None  # its callees are still traced
            if event == "line":
                counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
            return tracer

        decode = 0
        steps = step_times(ours, spec)
        for phase, _ in steps:
            decode += phase == "decode"
            if decode == skip:
                sys.settrace(tracer)
            elif decode == skip + traced:
                sys.settrace(None)
                break
        steps.close()
        per_side.append(Counter({k: v / traced for k, v in counts.items()}))
    base, mine = per_side
    extra = Counter(mine)
    extra.subtract(base)
    return {
        "context": spec.context,
        "running": spec.running,
        "vllm": round(sum(base.values())),
        "ours": round(sum(mine.values())),
        "extra": round(sum(extra.values())),
        "traced_steps": traced,
        "top": [[name, round(n)] for name, n in extra.most_common(12)],
    }


# ---- evict ------------------------------------------------------------------


def _ready(i: int) -> ChunkStatus:
    c = ChunkStatus(i)
    c.ref_cnt = 0
    return c


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def evict_cost(chunks: int, rounds: int) -> dict:
    """p99 of evict(1) + insert with every chunk retained (ours) and with
    none (vLLM's LRU), ``rounds`` each, interleaved so noise hits both."""
    rng = random.Random(0)
    lru, ours = LRUCachePolicy(chunks), SessionCachePolicy(chunks)
    for i in range(chunks):
        compat.insert(lru, _key(i), _ready(i))
        ours.insert(_key(i), _ready(i))
    for i in range(0, chunks, 512):
        ours.retain(
            [_key(j) for j in range(i, min(chunks, i + 512))],
            rng.randint(1, 80),
            None,
            owner=f"s{i // 512}",
        )
    times = {"lru": [], "ours": []}
    nxt = chunks
    for r in range(rounds):
        for name, p in (("lru", lru), ("ours", ours)):
            t0 = time.perf_counter()
            ((k, c),) = p.evict(1, set())
            compat.insert(p, _key(nxt), c)
            if name == "ours":
                p.retain([_key(nxt)], rng.randint(1, 80), None, owner=f"s{r}")
            times[name].append(time.perf_counter() - t0)
        nxt += 1
    lru_p99, ours_p99 = pct(times["lru"], 99), pct(times["ours"], 99)
    return {
        "chunks": chunks,
        "rounds": rounds,
        "lru_p99_ms": ms(lru_p99),
        "ours_p99_ms": ms(ours_p99),
        "ratio": round(ours_p99 / lru_p99, 3),
    }


# ---- expiry and status ------------------------------------------------------


def sessions_and_pins(sessions: int, pins: int, expiring: int, blocks: int) -> dict:
    """The tier manager of a real scheduler; ``sessions`` live sessions of
    ``blocks`` G2 blocks each, ``pins`` pinned chunks among the ones that
    stay, ``expiring`` sessions idle past the timeout (each with pins of
    its own): one ``status``, then ``expire_sessions`` pass by pass."""
    sched = make_scheduler(True, StepSpec(context=1024, running=1, g2_chunks=G2_CHUNKS))
    manager = sched.connector.manager
    policy = manager.primary_tier.policy
    index = manager.index
    timeout = manager.service.config.policy.sessions.idle_timeout_s
    t_new, t_old = 10 * timeout, 8 * timeout
    slot = 0
    pinned_live = 0
    for s in range(sessions):
        name = f"s{s}"
        chain = [_key(slot + j) for j in range(blocks)]
        for j, k in enumerate(chain):
            policy.insert(k, _ready(slot + j))
        slot += blocks
        old = s < expiring
        index.admit(name, chain, Tier.G2, now=t_old if old else t_new)
        want = 4 if old else min(blocks, pins - pinned_live)
        if want > 0:
            hint = make_hint(Action.PIN, name, ttl_s=600.0, max_blocks=want)
            (out,) = manager.service.control_hints([hint], name, client=name)
            if not old:
                pinned_live += out.blocks_affected
    live_pins = manager.service.executor.pinned_chunks
    gc.collect()
    t0 = time.perf_counter()
    status = manager.service.status()
    status_s = time.perf_counter() - t0
    passes = []  # as the connector expires: a budget per scheduler pass
    more = True
    while more:
        t0 = time.perf_counter()
        more = manager.service.expire_sessions(t_new + 1.0, EXPIRE_PER_PASS)
        passes.append(time.perf_counter() - t0)
    sched.shutdown()
    return {
        "sessions": sessions,
        "pins_live": pinned_live,
        "pins_before_expiry": live_pins,
        "expired": expiring,
        "expire_passes": len(passes),
        "expire_worst_pass_ms": ms(max(passes)),
        "expire_total_ms": ms(sum(passes)),
        "status_lock_max_ms": status["lock_max_ms"],
        "status_total_ms": ms(status_s),
        "status_sessions": len(status["sessions"]),
        "sessions_after": index.num_sessions,
    }


# ---- soak -------------------------------------------------------------------

TURN_BLOCKS = 32  # blocks a turn adds (512 tokens at block size 16)


def soak(hours: float, turns_per_min: int, g2_chunks: int, live: int) -> dict:
    """The index's size and the process RSS over ``hours`` of simulated
    time, per hour. ``live`` sessions take turns in rotation (each about every
    ``live / turns_per_min`` minutes, inside the default policy's 1 h idle
    timeout); a session ends
    after 2 to 30 turns, half of them told to end, half left to idle out, and
    a new one takes its place. A turn admits its ``TURN_BLOCKS`` new blocks,
    stores them in G2 through the primary tier (evicting what the policy
    chooses), records their write-through G3 copies as a cascade's end does,
    and lets their G1 copies go (the turn ends in a tool call)."""
    sched = make_scheduler(True, StepSpec(context=1024, running=1, g2_chunks=g2_chunks))
    manager = sched.connector.manager
    primary, index = manager.primary_tier, manager.index
    rng = random.Random(1)
    made, next_key, samples = 0, 0, []
    proc = psutil.Process()

    def new_session() -> tuple[str, bytes | None, int]:
        nonlocal made
        made += 1
        return f"soak{made}", None, rng.randint(2, 30)

    ring = [new_session() for _ in range(live)]  # (session, its last key, turns left)
    t0, turn = time.perf_counter(), 0
    for minute in range(int(hours * 60) + 1):
        now = 60.0 * minute
        if minute % 60 == 0:
            gc.collect()
            samples.append(
                {
                    "hour": minute // 60,
                    "nodes": len(index),
                    "sessions": index.num_sessions,
                    "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
            )
        for _ in range(turns_per_min):
            i = turn % live
            turn += 1
            name, last, left = ring[i]
            new = [_key(next_key + j) for j in range(TURN_BLOCKS)]
            next_key += TURN_BLOCKS
            ctx = ReqContext(req_id=f"t{turn}")
            with manager.lock:
                if last is None or not index.extend(name, last, new, Tier.G1, now=now):
                    index.admit(name, new, Tier.G1, now=now)
                out = primary.prepare_store(new, ctx)
                if out is not None and out.keys_to_store:
                    primary.complete_store(out.keys_to_store, ctx)
                    primary.set_copies(Tier.G3, out.keys_to_store, 1)  # the cascade's end
                index.set_copies(Tier.G1, new, 0)
                primary.on_request_finished(ctx)
            if left > 1:
                ring[i] = (name, new[-1], left - 1)
                continue
            if rng.random() < 0.5:
                manager.service.end_session(name, now=now)
            ring[i] = new_session()
        while manager.service.expire_sessions(now, EXPIRE_PER_PASS):
            pass
    sched.shutdown()
    at = {s["hour"]: s for s in samples}
    first = at[min(2, max(at))]
    last = samples[-1]
    growth = {k: round(last[k] / first[k] - 1, 4) for k in ("nodes", "rss_mib")}
    # Resident: G2's chunks and the G3 copies known (G1 holds none between
    # turns here); the rest are sessions' frontiers, one per session at most.
    bound = g2_chunks * (1 + G3_KNOWN_PER_G2_CHUNK) + max(s["sessions"] for s in samples)
    return {
        "nodes_bound": bound,
        "nodes_max": max(s["nodes"] for s in samples),
        "hours": hours,
        "turns_per_min": turns_per_min,
        "g2_chunks": g2_chunks,
        "live_sessions": live,
        "turn_blocks": TURN_BLOCKS,
        "sessions_made": made,
        "blocks_admitted": next_key,
        "growth_from_hour_2": growth,
        "per_hour": samples,
    }


# ---- pin memory (issue 52) -----------------------------------------------------


def hint_hold_figures(quick: bool) -> dict:
    """``bench/scale_holds.py``'s figures, sliced and as one slice."""
    import scale_holds

    g2, n = (16_384, 2048) if quick else (G2_CHUNKS, 16_384)
    return {
        "sliced": scale_holds.hint_holds(g2, n),
        "one_slice": scale_holds.hint_holds(g2, n, slice_chunks=n),
    }


def pin_memory_figures(quick: bool) -> dict:
    """``bench/pin_memory.py``'s figures for a Pin of a 6,250-chunk session
    (625 with ``quick``) on the disk tier."""
    import pin_memory

    return pin_memory.measure("disk", 625 if quick else 6250)


# ---- main -------------------------------------------------------------------


def check(figure: float, target: float) -> dict:
    return {"value": figure, "target": target, "met": figure <= target}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = ap.parse_args()
    t0 = time.time()
    q = args.quick
    long_ctx, short_ctx = (8192, 1024) if q else (65_536, 4096)
    running = 32 if q else 256
    out: dict = {"quick": q}
    reps = 1 if q else REPEATS
    g2 = 4096 if q else G2_CHUNKS
    for name, ctx in (("steps_64k", long_ctx), ("steps_4k", short_ctx)):
        out[name] = steps(step_spec(ctx, running, g2, DECODE_STEPS), reps)
    # The noise floor: vLLM's connector against itself, one run at 64k.
    aa = steps(step_spec(long_ctx, running, g2, DECODE_STEPS), 1, same=True)["decode"]
    out["noise_floor_64k"] = {"extra": aa["extra"], "extra_of_totals": aa["extra_of_totals"]}
    out["lines_4k"] = lines_per_step(step_spec(short_ctx, running, g2, 32))
    out["evict"] = evict_cost(16_384 if q else G2_CHUNKS, 200 if q else 2000)
    out["expiry"] = sessions_and_pins(
        1000 if q else 10_000, 1600 if q else 16_384, 100 if q else 1000, 16
    )
    out["soak"] = soak(
        3 if q else 24, 50 if q else 200, 4096 if q else G2_CHUNKS, 500 if q else 10_000
    )
    out["pin_memory"] = pin_memory_figures(q)
    out["hint_holds"] = hint_hold_figures(q)
    dec_long = out["steps_64k"]["decode"]["extra"]["p99_ms"]
    dec_short = out["steps_4k"]["decode"]["extra"]["p99_ms"]
    out["targets"] = {
        "extra_per_decode_step_p99_ms": check(dec_long, 0.5),
        "extra_ratio_64k_to_4k": check(round(dec_long / max(dec_short, 1e-6), 3), 1.2),
        "evict_p99_ratio_to_lru": check(out["evict"]["ratio"], 2.0),
        "expire_1000_sessions_ms": check(out["expiry"]["expire_worst_pass_ms"], 5.0),
        "status_lock_ms": check(out["expiry"]["status_lock_max_ms"], 5.0),
        "soak_index_nodes_growth_hour_2_to_end": check(
            abs(out["soak"]["growth_from_hour_2"]["nodes"]), 0.05
        ),
        "soak_rss_growth_hour_2_to_end": check(out["soak"]["growth_from_hour_2"]["rss_mib"], 0.05),
        "soak_index_nodes_over_resident_bound": check(
            round(out["soak"]["nodes_max"] / out["soak"]["nodes_bound"], 4), 1.0
        ),
        "pin_memory_over_idle_mib": check(
            out["pin_memory"]["worst_over_idle_mib"], out["pin_memory"]["target_mib"]
        ),
    }
    out["targets_met"] = all(t["met"] for t in out["targets"].values())
    out["wall_s"] = round(time.time() - t0, 1)
    Path(args.json).write_text(json.dumps(out, indent=1))
    for name, t in out["targets"].items():
        print(f"{name}: {t['value']} (target {t['target']}) {'met' if t['met'] else 'NOT met'}")
    lines = out["lines_4k"]
    print(
        f"lines per decode step ({lines['running']} x {lines['context']}): ours "
        f"{lines['ours']}, vLLM's {lines['vllm']}, extra {lines['extra']}"
    )
    print("targets_met:", out["targets_met"], f"({out['wall_s']} s)")


if __name__ == "__main__":
    main()
