"""Trace replay: G2 policies on a Mooncake-format trace against LRU, ARC and an
offline reference.

    python bench/replay.py --trace ../shared/traces/mooncake/conversation_trace.jsonl \\
        --g2-blocks 1024,4096,16384 --policies lru,arc,session,opt,naive \\
        [--g1-blocks K] [--workers W] [--routing sticky|random] [--shared-g3-blocks M] \\
        [--sharing] --json OUT [--plot OUT.png]

``--workers``, ``--routing`` and ``--shared-g3-blocks`` take comma lists too
(every combination runs). ``--sharing`` adds the issue's multi-worker matrix:
8 workers with G2 = 4096 each and the session policy, sticky without G3,
random without G3, random with a shared G3 of 8192..65536 blocks. The
simulator is in ``replay_sim.py``, the routers' hint policies in
``replay_router.py``; bench/README.md documents both and the JSON keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from replay_plot import write_plot
from replay_sim import ALL_POLICIES, RunSpec, gap_breakdown, run_policy
from replay_trace import load_trace

SHARING_G2 = 4096
SHARING_WORKERS = 8
SHARING_G3 = (8192, 16384, 32768, 65536)
SHARING_G3_TARGET = 32768


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def specs_from(args) -> list[RunSpec]:
    """Every run the arguments ask for, single-worker grid first."""
    out = []
    for w in ints(args.workers):
        for routing in args.routing.split(","):
            for g3 in ints(args.shared_g3_blocks):
                if w == 1 and (routing != args.routing.split(",")[0] or g3):
                    continue        # one worker: routing and shared G3 change nothing
                for n in ints(args.g2_blocks):
                    for p in args.policies.split(","):
                        if p not in ALL_POLICIES:
                            raise SystemExit(f"unknown policy {p!r}; one of {ALL_POLICIES}")
                        out.append(RunSpec(p, n, args.g1_blocks, w, routing, g3, args.seed))
    if args.sharing:
        s = dict(g1_blocks=args.g1_blocks, workers=SHARING_WORKERS, seed=args.seed)
        out.append(RunSpec("session", SHARING_G2, routing="sticky", **s))
        out.append(RunSpec("session", SHARING_G2, routing="random", **s))
        for g3 in SHARING_G3:
            out.append(RunSpec("session", SHARING_G2, routing="random", shared_g3_blocks=g3, **s))
    # The offline reference for every total capacity that a run has.
    have = {r.total_capacity for r in out if r.policy == "opt"}
    for r in list(out):
        if r.policy != "opt" and r.total_capacity not in have:
            have.add(r.total_capacity)
            out.append(RunSpec("opt", r.total_capacity, 0, 1, "sticky", 0, args.seed))
    return out


class Bar:
    """A one-line progress bar on stderr."""

    def __init__(self, runs: int, requests: int):
        self.runs, self.requests, self.k, self.label = runs, requests, 0, ""
        self.t0 = time.perf_counter()

    def start(self, spec: RunSpec) -> None:
        self.k += 1
        self.label = (f"{spec.policy} g2={spec.g2_blocks} w={spec.workers} "
                      f"{spec.routing} g3={spec.shared_g3_blocks}")
        self(0)

    def __call__(self, i: int) -> None:
        frac = i / max(1, self.requests)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{self.k}/{self.runs}] {bar:<30} {frac:4.0%} {self.label:<48} "
                         f"{time.perf_counter() - self.t0:6.0f}s")
        sys.stderr.flush()

    def done(self) -> None:
        sys.stderr.write("\n")


def table(runs: list[dict]) -> str:
    """The Markdown table printed on stdout."""
    head = ("| policy | G2 blocks | total blocks | workers | routing | shared G3 | token hit | block hit "
            "| x opt | recomputed prefill tokens | GB G2->G1 | GB G1->G2 | GB G3->G2 | GB G2->G3 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    gb = 1e9
    for r in runs:
        b = r["bytes_moved"]
        x = "" if r["ratio_to_opt"] is None else f"{r['ratio_to_opt']:.3f}"
        lines.append(
            f"| {r['policy']} | {r['g2_blocks'] if r['policy'] != 'opt' else '-'} "
            f"| {r['total_capacity_blocks']} | {r['workers']} | {r['routing']} "
            f"| {r['shared_g3_blocks']} | {r['token_hit_ratio']:.4f} | {r['block_hit_ratio']:.4f} "
            f"| {x} | {r['recomputed_prefill_tokens']:,} | {b['g2_to_g1'] / gb:.1f} "
            f"| {b['g1_to_g2'] / gb:.1f} | {b['g3_to_g2'] / gb:.1f} | {b['g2_to_g3'] / gb:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--g1-blocks", type=int, default=None,
                    help="G1 (vLLM prefix cache) blocks per worker; default G2/4")
    ap.add_argument("--g2-blocks", required=True, help="comma list of G2 capacities (blocks)")
    ap.add_argument("--policies", default="lru,arc,session,opt,naive")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--routing", default="sticky", help="sticky, random, or both")
    ap.add_argument("--shared-g3-blocks", default="0")
    ap.add_argument("--sharing", action="store_true",
                    help="add the 8-worker routing and shared-G3 matrix")
    ap.add_argument("--seed", type=int, default=0, help="random routing seed")
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    trace = load_trace(args.trace, args.limit)
    specs = specs_from(args)
    bar = Bar(len(specs), len(trace))
    runs = []
    for spec in specs:
        bar.start(spec)
        runs.append(run_policy(trace, spec, bar))
    bar.done()
    opt = {r["total_capacity_blocks"]: r["token_hit_ratio"] for r in runs if r["policy"] == "opt"}
    for r in runs:
        ref = opt.get(r["total_capacity_blocks"])
        r["ratio_to_opt"] = r["token_hit_ratio"] / ref if ref else None
    gaps = []
    for r in runs:
        ref = next((o for o in runs if o["policy"] == "opt"
                    and o["total_capacity_blocks"] == r["total_capacity_blocks"]), None)
        if r["policy"] in ("session", "session-oracle") and r["workers"] == 1 and ref:
            gaps.append({"policy": r["policy"], "g2_blocks": r["g2_blocks"],
                         "lost_vs_opt": gap_breakdown(trace, r, ref)})
    for r in runs:
        del r["_per_request"]
    out = {"trace": trace.name, "trace_stats": trace.stats(), "runs": runs,
           "gap_to_opt": gaps}
    by = {(r["policy"], r["workers"], r["routing"], r["shared_g3_blocks"]): r
          for r in runs if r["g2_blocks"] == SHARING_G2}
    sticky = by.get(("session", SHARING_WORKERS, "sticky", 0))
    shared = by.get(("session", SHARING_WORKERS, "random", SHARING_G3_TARGET))
    if sticky and shared:
        out["sharing_ratio"] = shared["token_hit_ratio"] / sticky["token_hit_ratio"]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(table([r for r in runs if r["policy"] != "opt" or r["workers"] == 1]))
    if "sharing_ratio" in out:
        print(f"\nrandom + shared G3 {SHARING_G3_TARGET} / sticky without G3 "
              f"(8 workers, G2 {SHARING_G2}): {out['sharing_ratio']:.3f}")
    for g in gaps:
        parts = ", ".join(f"{k}: {v:.4f}" for k, v in g["lost_vs_opt"].items())
        print(f"\n{g['policy']} at G2 {g['g2_blocks']}, prompt-token share opt hits and it "
              f"misses: {parts}")
    print(f"\nwall time: {out['wall_s']} s")
    if args.plot:
        grid = {r["total_capacity_blocks"] for r in runs if r["workers"] == 1 and r["policy"] != "opt"}
        print(write_plot(args.plot, [r for r in runs if r["workers"] == 1 and (
            r["policy"] != "opt" or r["total_capacity_blocks"] in grid)]))


if __name__ == "__main__":
    main()
