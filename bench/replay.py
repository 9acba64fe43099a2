"""Trace replay: G2 policies on Mooncake-format traces against LRU, ARC, the
simple "keep every continuing session" strategy and an offline reference.

    python bench/replay.py [--trace ../shared/traces/mooncake/conversation_trace.jsonl] \\
        [--g2-blocks 1024,4096,16384] [--policies lru,arc,naive,naive-unbounded,session,opt] \\
        [--g1-blocks K] [--workers W] [--routing sticky|random] [--shared-g3-blocks M] \\
        [--sharing] --json OUT [--plot OUT.png]
    python bench/replay.py --suite [--trace A.jsonl,B.jsonl] [--out-dir DIR]

``--workers``, ``--routing`` and ``--shared-g3-blocks`` take comma lists too
(every combination runs). ``--sharing`` adds the multi-worker matrix: 8
workers with G2 = 4096 each and the session policy, sticky without G3,
random without G3, random with a shared G3 of 8192..65536 blocks.
``--suite`` replays lru, arc, naive, naive-unbounded, session and opt at G2
1024, 4096 and 16384 on the given traces and on every trace generated from
``bench/traces/*.yaml`` (``tracegen.py``), writes one JSON and one plot per
trace and ``suite.json``, and prints the ratios to opt. Every run also gets
resumed-turn TTFT and oracle gain captured under the time model's parameter
sets (``replay_time.py``: ``cpu``, ``h100-8b``). The simulator is in
``replay_sim.py``, the adapters to the routers' policies in
``replay_router.py`` (``session`` is ``sessionkv.router.hinting``,
what ``sessionkv router`` runs); bench/README.md documents them and the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import tracegen
from replay_plot import write_plot
from replay_sim import ALL_POLICIES, RunSpec, gap_breakdown, run_policy
from replay_time import PARAMS, add_times
from replay_trace import load_trace
from tqdm import tqdm

SHARING_G2 = 4096
SHARING_WORKERS = 8
SHARING_G3 = (8192, 16384, 32768, 65536)
SHARING_G3_TARGET = 32768
SUITE_G2 = (1024, 4096, 16384)
SUITE_POLICIES = ("lru", "arc", "naive", "naive-unbounded", "session")
CONVERSATION = str(
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake/conversation_trace.jsonl"
)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def specs_from(args) -> list[RunSpec]:
    """Every run the arguments ask for, single-worker grid first."""
    out = []
    for w in ints(args.workers):
        for routing in args.routing.split(","):
            for g3 in ints(args.shared_g3_blocks):
                if w == 1 and (routing != args.routing.split(",")[0] or g3):
                    continue  # one worker: routing and shared G3 change nothing
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


class Progress:
    """A tqdm bar per run over the trace's requests (plain lines when stderr
    is not a terminal)."""

    def __init__(self, runs: int, requests: int):
        self.runs, self.requests, self.k = runs, requests, 0
        self._bar = None

    def start(self, spec: RunSpec, trace: str = "") -> None:
        self.done()
        self.k += 1
        label = (
            f"[{self.k}/{self.runs}] {trace} {spec.policy} g2={spec.g2_blocks} "
            f"w={spec.workers} {spec.routing} g3={spec.shared_g3_blocks}"
        )
        tty = sys.stderr.isatty()
        self._bar = tqdm(
            total=self.requests,
            desc=label,
            unit="req",
            leave=tty,
            mininterval=0.5 if tty else 30.0,
            file=sys.stderr,
        )
        self._at = 0

    def __call__(self, i: int) -> None:
        self._bar.update(i - self._at)
        self._at = i

    def done(self) -> None:
        if self._bar is not None:
            self._bar.update(self.requests - self._at)
            self._bar.close()
            self._bar = None


def table(runs: list[dict]) -> str:
    """The Markdown table printed on stdout."""
    head = (
        "| policy | G2 blocks | total blocks | workers | routing | shared G3 | token hit | block hit "
        "| x opt | recomputed prefill tokens | GB G2->G1 | GB G1->G2 | GB G3->G2 | GB G2->G3 |"
    )
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
            f"| {b['g1_to_g2'] / gb:.1f} | {b['g3_to_g2'] / gb:.1f} | {b['g2_to_g3'] / gb:.1f} |"
        )
    return "\n".join(lines)


def time_table(runs: list[dict]) -> str:
    """Resumed-turn TTFT per run and parameter set (``replay_time``): the
    one-worker runs, ``opt`` as the oracle."""
    head = (
        "| policy | G2 blocks | parameters | TTFT p50 s | TTFT p90 s | TTFT mean s "
        "| hint wait s | load s | prefill s | oracle gain captured |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        for name, t in r.get("time", {}).items():
            if not t.get("turns"):
                continue
            cap = t.get("oracle_gain_captured")
            lines.append(
                f"| {'oracle' if r['policy'] == 'opt' else r['policy']} "
                f"| {r['g2_blocks'] if r['policy'] != 'opt' else '-'} | {name} "
                f"| {t['ttft_p50_s']:.3f} | {t['ttft_p90_s']:.3f} | {t['ttft_mean_s']:.3f} "
                f"| {t['hint_wait_mean_s']:.4f} | {t['load_mean_s']:.4f} | {t['prefill_mean_s']:.3f} "
                f"| {'' if cap is None else f'{cap:.3f}'} |"
            )
    return "\n".join(lines)


def replay(trace, specs: list[RunSpec]) -> dict:
    """Every run of ``specs`` on ``trace``: the JSON document (see bench/README.md)."""
    t0 = time.perf_counter()
    bar = Progress(len(specs), len(trace))
    runs = []
    for spec in specs:
        bar.start(spec, trace.name)
        runs.append(run_policy(trace, spec, bar))
    bar.done()
    opt = {r["total_capacity_blocks"]: r["token_hit_ratio"] for r in runs if r["policy"] == "opt"}
    for r in runs:
        ref = opt.get(r["total_capacity_blocks"])
        r["ratio_to_opt"] = r["token_hit_ratio"] / ref if ref else None
    gaps = []
    for r in runs:
        ref = next(
            (
                o
                for o in runs
                if o["policy"] == "opt" and o["total_capacity_blocks"] == r["total_capacity_blocks"]
            ),
            None,
        )
        if r["policy"] == "session" and r["workers"] == 1 and ref:
            gaps.append(
                {
                    "policy": r["policy"],
                    "g2_blocks": r["g2_blocks"],
                    "lost_vs_opt": gap_breakdown(trace, r, ref),
                }
            )
    add_times(trace, runs)
    for r in runs:
        for k in ("_per_request", "_g1_tokens", "_events"):
            r.pop(k, None)
    out = {"trace": trace.name, "trace_stats": trace.stats(), "runs": runs, "gap_to_opt": gaps}
    by = {
        (r["policy"], r["workers"], r["routing"], r["shared_g3_blocks"]): r
        for r in runs
        if r["g2_blocks"] == SHARING_G2
    }
    sticky = by.get(("session", SHARING_WORKERS, "sticky", 0))
    shared = by.get(("session", SHARING_WORKERS, "random", SHARING_G3_TARGET))
    if sticky and shared:
        out["sharing_ratio"] = shared["token_hit_ratio"] / sticky["token_hit_ratio"]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def single_worker(runs: list[dict]) -> list[dict]:
    """The one-worker runs and the references for their capacities."""
    grid = {r["total_capacity_blocks"] for r in runs if r["workers"] == 1 and r["policy"] != "opt"}
    return [
        r
        for r in runs
        if r["workers"] == 1 and (r["policy"] != "opt" or r["total_capacity_blocks"] in grid)
    ]


def suite_traces(args) -> list[Path]:
    """The conversation trace(s) given, then every generated trace (written
    once into the output folder from bench/traces/*.yaml)."""
    out = [Path(t) for t in args.trace.split(",") if t]
    folder = Path(args.out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for params in sorted((Path(__file__).parent / "traces").glob("*.yaml")):
        path = folder / f"{params.stem}.jsonl"
        if not path.exists():
            reqs = tracegen.generate(tracegen.Params.load(str(params)))
            path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in reqs))
        out.append(path)
    return out


def suite_table(rows: list[dict]) -> str:
    """Ratio to opt per trace and capacity, and the shipped policy over the
    best simple one."""
    head = "| trace | G2 blocks | " + " | ".join(SUITE_POLICIES) + " | session / best simple |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = " | ".join(f"{r['x_opt'][p]:.3f}" for p in SUITE_POLICIES)
        lines.append(
            f"| {r['trace']} | {r['g2_blocks']} | {cells} | {r['session_over_best']:.3f} |"
        )
    return "\n".join(lines)


SIMPLE = ("lru", "arc", "naive")  # the simple policies the shipped one must match on time


def suite_time(runs: list[dict], n: int) -> dict:
    """Per parameter set at G2 ``n``: resumed-turn TTFT per policy and the
    oracle, oracle gain captured, and whether ``session`` is at or above the
    best of ``SIMPLE`` on it."""
    out = {}
    at = [r for r in runs if r["policy"] != "opt" and r["g2_blocks"] == n and r["workers"] == 1]
    total = at[0]["total_capacity_blocks"] if at else None
    orc = next(
        (r for r in runs if r["policy"] == "opt" and r["total_capacity_blocks"] == total), None
    )
    for name in PARAMS:
        t = {r["policy"]: r["time"][name] for r in at}
        o = orc["time"][name] if orc else {}
        cap = {p: v.get("oracle_gain_captured") for p, v in t.items()}
        row = {
            f"ttft_{k}_s": {p: v.get(f"ttft_{k}_s") for p, v in t.items()}
            for k in ("p50", "p90", "mean")
        }
        row["oracle"] = {k: o.get(f"ttft_{k}_s") for k in ("p50", "p90", "mean")}
        row["oracle"]["mean_unqueued"] = o.get("ttft_mean_s_unqueued")
        row["oracle_gain_captured"] = cap
        best = max((cap[p] for p in SIMPLE if cap.get(p) is not None), default=None)
        s = cap.get("session")
        row["session_at_or_above_best_simple"] = (
            None if s is None or best is None else s >= best - 1e-9
        )
        out[name] = row
    return out


def suite_time_table(rows: list[dict]) -> str:
    """Oracle gain captured per trace, capacity and parameter set."""
    head = (
        "| trace | G2 blocks | parameters | "
        + " | ".join(SUITE_POLICIES)
        + " | oracle TTFT mean s | session TTFT mean s | session >= best of lru, arc, naive |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for name, t in r["time"].items():
            cap = t["oracle_gain_captured"]
            cells = " | ".join(
                "-" if cap.get(p) is None else f"{cap[p]:.3f}" for p in SUITE_POLICIES
            )
            om, sm = t["oracle"]["mean"], t["ttft_mean_s"].get("session")
            ok = t["session_at_or_above_best_simple"]
            lines.append(
                f"| {r['trace']} | {r['g2_blocks']} | {name} | {cells} "
                f"| {'-' if om is None else f'{om:.3f}'} "
                f"| {'-' if sm is None else f'{sm:.3f}'} "
                f"| {'-' if ok is None else ('yes' if ok else 'NO')} |"
            )
    return "\n".join(lines)


def run_suite(args) -> None:
    rows = []
    folder = Path(args.out_dir)
    for path in suite_traces(args):
        trace = load_trace(path, args.limit)
        specs = [
            RunSpec(p, n, args.g1_blocks, 1, "sticky", 0, args.seed)
            for n in SUITE_G2
            for p in SUITE_POLICIES
        ]
        specs += [
            RunSpec("opt", s.total_capacity, 0, 1, "sticky", 0, args.seed)
            for s in specs
            if s.policy == "session"
        ]
        out = replay(trace, specs)
        (folder / f"{path.stem}.json").write_text(json.dumps(out, indent=1))
        print(
            write_plot(
                str(folder / f"{path.stem}.png"),
                single_worker(out["runs"]),
                title=f"{path.stem}: token hit ratio by G2 capacity",
            ),
            file=sys.stderr,
        )
        for n in SUITE_G2:
            x = {
                r["policy"]: r["ratio_to_opt"]
                for r in out["runs"]
                if r["policy"] != "opt" and r["g2_blocks"] == n
            }
            best = max(x[p] for p in SUITE_POLICIES if p != "session")
            rows.append(
                {
                    "trace": path.stem,
                    "g2_blocks": n,
                    "x_opt": x,
                    "session_over_best": x["session"] / best if best else float("inf"),
                    "time": suite_time(out["runs"], n),
                }
            )
        (folder / "suite.json").write_text(json.dumps(rows, indent=1))  # so far, per trace
    print(suite_table(rows))
    print("\nOracle gain captured on mean resumed-turn TTFT (bench/replay_time.py):\n")
    print(suite_time_table(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trace", default=CONVERSATION, help="a Mooncake-format trace (with --suite: a comma list)"
    )
    ap.add_argument(
        "--g1-blocks",
        type=int,
        default=None,
        help="G1 (vLLM prefix cache) blocks per worker; default G2/4",
    )
    ap.add_argument(
        "--g2-blocks", default="1024,4096,16384", help="comma list of G2 capacities (blocks)"
    )
    ap.add_argument("--policies", default="lru,arc,naive,naive-unbounded,session,opt")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--routing", default="sticky", help="sticky, random, or both")
    ap.add_argument("--shared-g3-blocks", default="0")
    ap.add_argument(
        "--sharing", action="store_true", help="add the 8-worker routing and shared-G3 matrix"
    )
    ap.add_argument(
        "--suite",
        action="store_true",
        help="the policy matrix over the given and the generated traces",
    )
    ap.add_argument("--out-dir", default="replay-suite", help="--suite: where JSON and plots go")
    ap.add_argument("--seed", type=int, default=0, help="random routing seed")
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.suite:
        return run_suite(args)
    if args.json is None:
        ap.error("--json is required (or --suite)")
    trace = load_trace(args.trace, args.limit)
    out = replay(trace, specs_from(args))
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(table([r for r in out["runs"] if r["policy"] != "opt" or r["workers"] == 1]))
    print("\nresumed turns, time model (bench/replay_time.py):\n")
    print(time_table(single_worker(out["runs"])))
    if "sharing_ratio" in out:
        print(
            f"\nrandom + shared G3 {SHARING_G3_TARGET} / sticky without G3 "
            f"(8 workers, G2 {SHARING_G2}): {out['sharing_ratio']:.3f}"
        )
    for g in out["gap_to_opt"]:
        parts = ", ".join(f"{k}: {v:.4f}" for k, v in g["lost_vs_opt"].items())
        print(
            f"\n{g['policy']} at G2 {g['g2_blocks']}, prompt-token share opt hits and it "
            f"misses: {parts}"
        )
    print(f"\nwall time: {out['wall_s']} s")
    if args.plot:
        print(write_plot(args.plot, single_worker(out["runs"]), title=trace.name))


if __name__ == "__main__":
    main()
