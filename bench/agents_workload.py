"""The agents bench's workload and its figures (``bench/agents.py`` runs them).

A *task* is one agent session: an LLM turn, a tool call, the next turn, ...
Turn 1's prompt is an optional shared document (one of ``docs``: a long
repository or manual several agents read) followed by the task's own
instructions; turn k+1's prompt is turn k's prompt, its output, and the tool's
result. Everything but the outputs is drawn up front from one seed, so every
mode and run sends the same tasks; the outputs are greedy, so when they are
exact (the bench checks it) the prompts are the same too.

Tool calls last a log-normal time (``tool_median_s``, ``tool_sigma``),
truncated to ``[0.2 s, tool_max_s]``: agent tool calls (tests, builds,
searches, a human's approval) are mostly seconds with a tail of minutes; the
defaults (median 10 s, up to 60 s) are real durations divided by about two
to three for this machine. At a 5 s median the two one-core engines were
busy 92 % of the time, and a resumed turn's TTFT was its wait behind other
agents' turns rather than what its cache held (bench/README).

Nothing here talks to a server.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

VOCAB = (10, 4000)          # token ids drawn from this range (the local models' vocabulary)


@dataclass(frozen=True)
class Shape:
    """How big the tasks are (tokens, seconds)."""

    tasks: int = 16
    docs: int = 2                    # shared documents; 1 task in 3 starts with one
    doc_tokens: int = 1024
    task_tokens: int = 384           # a task's own instructions
    turns: tuple[int, int] = (3, 5)  # turns per task, uniform, inclusive
    tool_tokens: tuple[int, int] = (32, 128)   # a tool result, uniform, inclusive
    output_tokens: int = 16          # per turn (greedy, ignore_eos)
    tool_median_s: float = 10.0
    tool_sigma: float = 1.0
    tool_max_s: float = 60.0
    seed: int = 0


@dataclass(frozen=True)
class Task:
    i: int
    doc: int | None                  # which shared document it starts with, if any
    head: tuple[int, ...]            # turn 1's prompt
    tools: tuple[float, ...]         # tool call after turn k (len = turns - 1)
    results: tuple[tuple[int, ...], ...]   # the tool results, appended after turn k's output

    @property
    def turns(self) -> int:
        return len(self.tools) + 1


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(rng.integers(*VOCAB, n).tolist())


def tool_seconds(rng: np.random.Generator, shape: Shape, n: int) -> list[float]:
    draw = rng.lognormal(math.log(shape.tool_median_s), shape.tool_sigma, n)
    return [float(min(max(x, 0.2), shape.tool_max_s)) for x in draw]


def make_tasks(shape: Shape) -> list[Task]:
    rng = np.random.default_rng(shape.seed)
    docs = [_tokens(rng, shape.doc_tokens) for _ in range(shape.docs)]
    tasks = []
    for i in range(shape.tasks):
        doc = i // 3 % shape.docs if shape.docs and i % 3 == 0 else None
        turns = int(rng.integers(shape.turns[0], shape.turns[1] + 1))
        head = (docs[doc] if doc is not None else ()) + _tokens(rng, shape.task_tokens)
        results = tuple(_tokens(rng, int(rng.integers(shape.tool_tokens[0],
                                                      shape.tool_tokens[1] + 1)))
                        for _ in range(turns - 1))
        tasks.append(Task(i, doc, head, tuple(tool_seconds(rng, shape, turns - 1)), results))
    return tasks


def max_context(shape: Shape) -> int:
    """The longest prompt plus output any task reaches."""
    return (shape.doc_tokens + shape.task_tokens + shape.turns[1] * shape.output_tokens
            + (shape.turns[1] - 1) * shape.tool_tokens[1])


def live_working_set(tasks: list[Task], shape: Shape, agents: int, block: int,
                     samples: int = 4000) -> float:
    """The full blocks ``agents`` live agents on one engine hold together
    (a shared document once), averaged over random moments: each agent at a
    random turn of a random task, with that turn's prompt and output."""
    turns = []
    for t in tasks:
        n = len(t.head)
        for k in range(t.turns):
            turns.append((t, n + shape.output_tokens))
            if k < len(t.results):
                n += shape.output_tokens + len(t.results[k])
    rng = np.random.default_rng(shape.seed)
    sizes = []
    for _ in range(samples):
        blocks: set[tuple] = set()
        for j in rng.choice(len(turns), size=agents, replace=False):
            t, n = turns[j]
            doc = shape.doc_tokens if t.doc is not None else 0
            blocks |= {("doc", t.doc, b) for b in range(min(n, doc) // block)}
            blocks |= {("task", t.i, b) for b in range(doc // block, n // block)}
        sizes.append(len(blocks))
    return float(np.mean(sizes))


# ---- figures --------------------------------------------------------------

@dataclass
class TurnResult:
    task: int
    turn: int                  # 0 = the task's first turn
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int         # G1 hits plus the connector's loads (vLLM's usage)
    worker: str
    moved: bool                # a later turn on another worker than the previous turn
    prefix_tokens: int         # what the previous turn left: its prompt (0 for turn 0)
    cross_start: bool = False  # a first turn of a shared document on a worker new to it
    doc_tokens: int = 0
    output: list[int] = field(default_factory=list)
    prompt_key: str = ""
    error: str | None = None


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def turn_record(t: TurnResult) -> dict:
    """A turn as the JSON keeps it (no token ids)."""
    return {k: v for k, v in dataclasses.asdict(t).items() if k not in ("output", "prompt_key")}


def run_figures(turns: list[TurnResult], task_s: list[float]) -> dict:
    """The figures of one run."""
    ok = [t for t in turns if t.error is None]
    resumed = [t.ttft_s for t in ok if t.turn > 0]
    moved = [t for t in ok if t.moved and t.prefix_tokens]
    starts = [t for t in ok if t.cross_start and t.doc_tokens]
    return {
        "turns": len(turns), "errors": len(turns) - len(ok),
        "resumed_turns": len(resumed),
        "resumed_ttft_p50_s": _pct(resumed, 50), "resumed_ttft_p90_s": _pct(resumed, 90),
        "first_ttft_p50_s": _pct([t.ttft_s for t in ok if t.turn == 0], 50),
        "task_s_p50": _pct(task_s, 50), "task_s_mean": float(np.mean(task_s)) if task_s else None,
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "recomputed_tokens": sum(t.prompt_tokens - t.cached_tokens for t in ok),
        # Of that, what an earlier turn of the task had computed already (its
        # prompt): what a cache could have kept. The rest (first turns, tool
        # results) every mode computes.
        "prefix_recomputed_tokens": sum(max(0, t.prefix_tokens - t.cached_tokens)
                                        for t in ok if t.turn > 0),
        "moved_turns": len(moved),
        # Of a moved turn's prefix (its previous prompt), the share not served
        # from cache on the new worker: G1 there cannot have it (unless a
        # shared document), so what is served came from G3.
        "moved_prefix_recomputed_fraction": (
            sum(max(0, t.prefix_tokens - t.cached_tokens) for t in moved)
            / sum(t.prefix_tokens for t in moved)) if moved else None,
        "moved_ttft_p50_s": _pct([t.ttft_s for t in moved], 50),
        "cross_starts": len(starts),
        "cross_start_doc_cached_fraction": (
            sum(min(t.cached_tokens, t.doc_tokens) for t in starts)
            / sum(t.doc_tokens for t in starts)) if starts else None,
        "cross_start_ttft_p50_s": _pct([t.ttft_s for t in starts], 50),
    }


def _median(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return float(np.median(xs)) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(per_mode: dict[str, list[dict]]) -> dict:
    """Medians over runs per mode, the spread (min, max), and the ratios the
    issue's acceptance names (sessionkv against LRU and the oracle)."""
    keys = ("resumed_ttft_p50_s", "resumed_ttft_p90_s", "task_s_p50", "recomputed_tokens",
            "prefix_recomputed_tokens",
            "moved_prefix_recomputed_fraction", "moved_ttft_p50_s",
            "cross_start_doc_cached_fraction", "cross_start_ttft_p50_s", "moved_turns")
    table = {}
    for mode, runs in per_mode.items():
        row = {}
        for k in keys:
            xs = [r[k] for r in runs if r.get(k) is not None]
            row[k] = _median(runs, k)
            row[k + "_spread"] = [float(min(xs)), float(max(xs))] if xs else None
        table[mode] = row
    ratios = {}
    for name, fn in {
            "resumed_ttft_p50_ratio_to_lru": lambda r: r.get("resumed_ttft_p50_s"),
            "recomputed_ratio_to_lru": lambda r: r.get("recomputed_tokens"),
            "prefix_recomputed_ratio_to_lru": lambda r: r.get("prefix_recomputed_tokens"),
            "task_s_p50_ratio_to_lru": lambda r: r.get("task_s_p50")}.items():
        ratios[name] = _median_ratio(per_mode, "sessionkv", "lru", fn)
    ratios["resumed_ttft_p50_ratio_to_oracle"] = _median_ratio(
        per_mode, "sessionkv", "oracle", lambda r: r.get("resumed_ttft_p50_s"))
    ratios["task_s_p50_ratio_to_plain"] = _median_ratio(
        per_mode, "sessionkv", "plain", lambda r: r.get("task_s_p50"))
    ratios["moved_prefix_recomputed_fraction"] = \
        table.get("sessionkv", {}).get("moved_prefix_recomputed_fraction")
    return {"modes": table, **ratios}


def _median_ratio(per_mode: dict[str, list[dict]], a: str, b: str, fn) -> float | None:
    """The median over rounds of (a's figure / b's figure) within one round
    (runs are interleaved, so a round's runs saw the same machine)."""
    xs = [_ratio(fn(ra), fn(rb)) for ra, rb in zip(per_mode.get(a, ()), per_mode.get(b, ()))]
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None
