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

VOCAB = (10, 4000)  # token ids drawn from this range (the local models' vocabulary)


@dataclass(frozen=True)
class Shape:
    """How big the tasks are (tokens, seconds)."""

    tasks: int = 16
    docs: int = 2  # shared documents; 1 task in 3 starts with one
    doc_tokens: int = 1024
    task_tokens: int = 384  # a task's own instructions
    turns: tuple[int, int] = (3, 5)  # turns per task, uniform, inclusive
    tool_tokens: tuple[int, int] = (32, 128)  # a tool result, uniform, inclusive
    output_tokens: int = 16  # per turn (greedy, ignore_eos)
    tool_median_s: float = 10.0
    tool_sigma: float = 1.0
    tool_max_s: float = 60.0
    seed: int = 0
    doc_every: int = 3  # 1 task in this many starts with a shared document
    subagent_p: float = 0.0  # a task's chance to hand one tool call to a sub-agent
    sub_turns: tuple[int, int] = (2, 4)
    compact_tokens: int = 0  # a context past this restarts from a summary (0: never)
    summary_tokens: int = 256


@dataclass(frozen=True)
class Task:
    """One agent session. Turn k+1's prompt is turn k's prompt, its output
    and ``results[k]``, except:

    - after turn ``sub_at``, a sub-agent runs ``sub`` (a task of its own,
      whose first prompt is the parent's prompt and output followed by
      ``sub.head``: it branches from the parent's context) in place of the
      tool call, and its last output goes before ``results[sub_at]``;
    - after a turn in ``compact_after``, the context is compacted: the next
      prompt is the shared document, that compaction's ``summaries`` entry
      and ``results[k]`` (the agent restarts from a summary)."""

    i: int
    doc: int | None  # which shared document it starts with, if any
    head: tuple[int, ...]  # turn 1's prompt
    tools: tuple[float, ...]  # tool call after turn k (len = turns - 1)
    results: tuple[tuple[int, ...], ...]  # the tool results, appended after turn k's output
    sub: Task | None = None
    sub_at: int = -1
    compact_after: tuple[int, ...] = ()
    summaries: tuple[tuple[int, ...], ...] = ()
    doc_tokens: int = 0  # of ``head``, the shared document's

    @property
    def turns(self) -> int:
        return len(self.tools) + 1

    def prompt_lengths(self, output_tokens: int, start: int = 0) -> list[int]:
        """Each turn's prompt length (``start``: a sub-agent's parent context)."""
        n, out = start + len(self.head), []
        for k in range(self.turns):
            out.append(n)
            if k == len(self.results):
                break
            grow = output_tokens + len(self.results[k])
            if k == self.sub_at and self.sub is not None:
                grow += output_tokens
            if k in self.compact_after:
                n = (
                    self.doc_tokens
                    + len(self.summaries[self.compact_after.index(k)])
                    + len(self.results[k])
                )
            else:
                n += grow
        return out


def coding_shape(seed: int = 0) -> Shape:
    """Agentic coding, scaled to this machine (bench/README: "the coding
    workload"). Public figures it follows (llm-d's study of 219 Claude Code
    sessions): tens of turns per task, tool gaps p50 2 s / p90 24 s / p99
    11.4 min, 96 % of turns reusing >= 90 % of their prefix, contexts that
    grow until compacted. Here: 12-20 turns over a shared repository prefix
    (every task starts with one of two), gaps log-normal with a 1 s median
    and a p90 of about 11 s (real durations halved, as the default
    workload's are), truncated at 90 s; half the tasks hand one tool call to
    a sub-agent that branches from the task's context; a context past 4,096
    tokens restarts from a 256-token summary. What matters is context / G1
    and sessions / tier (``--coding`` sizes them), not absolute tokens."""
    return Shape(
        tasks=12,
        docs=2,
        doc_tokens=1024,
        doc_every=1,
        task_tokens=256,
        turns=(12, 20),
        tool_tokens=(64, 256),
        output_tokens=16,
        tool_median_s=1.0,
        tool_sigma=1.9,
        tool_max_s=90.0,
        seed=seed,
        subagent_p=0.5,
        sub_turns=(2, 4),
        compact_tokens=4096,
        summary_tokens=256,
    )


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(rng.integers(*VOCAB, n).tolist())


def tool_seconds(rng: np.random.Generator, shape: Shape, n: int) -> list[float]:
    draw = rng.lognormal(math.log(shape.tool_median_s), shape.tool_sigma, n)
    return [float(min(max(x, 0.2), shape.tool_max_s)) for x in draw]


def _results(rng: np.random.Generator, shape: Shape, n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(
        _tokens(rng, int(rng.integers(shape.tool_tokens[0], shape.tool_tokens[1] + 1)))
        for _ in range(n)
    )


def make_tasks(shape: Shape) -> list[Task]:
    rng = np.random.default_rng(shape.seed)
    docs = [_tokens(rng, shape.doc_tokens) for _ in range(shape.docs)]
    tasks = []
    for i in range(shape.tasks):
        every = shape.doc_every
        doc = i // every % shape.docs if shape.docs and i % every == 0 else None
        turns = int(rng.integers(shape.turns[0], shape.turns[1] + 1))
        head = (docs[doc] if doc is not None else ()) + _tokens(rng, shape.task_tokens)
        results = _results(rng, shape, turns - 1)  # drawn before the tool times
        task = Task(
            i,
            doc,
            head,
            tuple(tool_seconds(rng, shape, turns - 1)),
            results,
            doc_tokens=shape.doc_tokens if doc is not None else 0,
        )
        if shape.subagent_p and turns > 2 and rng.random() < shape.subagent_p:
            n = int(rng.integers(shape.sub_turns[0], shape.sub_turns[1] + 1))
            head, results = _tokens(rng, shape.task_tokens // 4), _results(rng, shape, n - 1)
            sub = Task(i, None, head, tuple(tool_seconds(rng, shape, n - 1)), results)
            task = dataclasses.replace(task, sub=sub, sub_at=int(rng.integers(1, turns - 1)))
        if shape.compact_tokens:
            compact, n = [], len(head)
            for k, r in enumerate(task.results):
                n += shape.output_tokens * (2 if k == task.sub_at else 1) + len(r)
                if n > shape.compact_tokens:
                    compact.append(k)
                    n = task.doc_tokens + shape.summary_tokens + len(r)
            task = dataclasses.replace(
                task,
                compact_after=tuple(compact),
                summaries=tuple(_tokens(rng, shape.summary_tokens) for _ in compact),
            )
        tasks.append(task)
    return tasks


def max_context(shape: Shape, tasks: list[Task] | None = None) -> int:
    """The longest prompt plus output any task reaches (of ``tasks``, or the
    bound the shape allows when it neither compacts nor branches)."""
    if tasks is None:
        return (
            shape.doc_tokens
            + shape.task_tokens
            + shape.turns[1] * shape.output_tokens
            + (shape.turns[1] - 1) * shape.tool_tokens[1]
        )
    out = 0
    for t in tasks:
        lengths = t.prompt_lengths(shape.output_tokens)
        out = max(out, max(lengths))
        if t.sub is not None:
            out = max(
                out,
                max(
                    t.sub.prompt_lengths(
                        shape.output_tokens, lengths[t.sub_at] + shape.output_tokens
                    )
                ),
            )
    return out + shape.output_tokens


def live_working_set(
    tasks: list[Task], shape: Shape, agents: int, block: int, samples: int = 4000
) -> float:
    """The full blocks ``agents`` live agents on one engine hold together
    (a shared document once), averaged over random moments: each agent at a
    random turn of a random task, with that turn's prompt and output."""
    turns = [
        (t, n + shape.output_tokens) for t in tasks for n in t.prompt_lengths(shape.output_tokens)
    ]
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
    turn: int  # 0 = the task's first turn
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int  # G1 hits plus the connector's loads (vLLM's usage)
    worker: str
    moved: bool  # a later turn on another worker than the previous turn
    prefix_tokens: int  # what the previous turn left: its prompt (0 for turn 0)
    cross_start: bool = False  # a first turn of a shared document on a worker new to it
    doc_tokens: int = 0
    output: list[int] = field(default_factory=list)
    prompt_key: str = ""
    error: str | None = None
    routed_s: float = 0.0  # the router's time before it forwarded the turn
    sub: bool = False  # a sub-agent's turn (``task``'s sub-agent)


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
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "resumed_turns": len(resumed),
        "resumed_ttft_p50_s": _pct(resumed, 50),
        "resumed_ttft_p90_s": _pct(resumed, 90),
        "first_ttft_p50_s": _pct([t.ttft_s for t in ok if t.turn == 0], 50),
        "task_s_p50": _pct(task_s, 50),
        "task_s_mean": float(np.mean(task_s)) if task_s else None,
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "recomputed_tokens": sum(t.prompt_tokens - t.cached_tokens for t in ok),
        # Of that, what an earlier turn of the task had computed already (its
        # prompt): what a cache could have kept. The rest (first turns, tool
        # results) every mode computes.
        "prefix_recomputed_tokens": sum(
            max(0, t.prefix_tokens - t.cached_tokens) for t in ok if t.turn > 0
        ),
        "moved_turns": len(moved),
        # Of a moved turn's prefix (its previous prompt), the share not served
        # from cache on the new worker: G1 there cannot have it (unless a
        # shared document), so what is served came from G3.
        "moved_prefix_recomputed_fraction": (
            sum(max(0, t.prefix_tokens - t.cached_tokens) for t in moved)
            / sum(t.prefix_tokens for t in moved)
        )
        if moved
        else None,
        "moved_ttft_p50_s": _pct([t.ttft_s for t in moved], 50),
        "cross_starts": len(starts),
        "cross_start_doc_cached_fraction": (
            sum(min(t.cached_tokens, t.doc_tokens) for t in starts)
            / sum(t.doc_tokens for t in starts)
        )
        if starts
        else None,
        "cross_start_ttft_p50_s": _pct([t.ttft_s for t in starts], 50),
        # Resumed turns' TTFT, split: the router's part (session state,
        # placement, a move's Share wait) and the rest (the engine, the wire).
        "resumed_routed_s_mean": float(np.mean([t.routed_s for t in ok if t.turn > 0]))
        if resumed
        else None,
        "resumed_routed_s_p90": _pct([t.routed_s for t in ok if t.turn > 0], 90),
        "resumed_engine_s_mean": float(np.mean([t.ttft_s - t.routed_s for t in ok if t.turn > 0]))
        if resumed
        else None,
    }


def _median(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return float(np.median(xs)) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(per_mode: dict[str, list[dict]]) -> dict:
    """Medians over runs per mode, the spread (min, max), and the ratios the
    issue's acceptance names (sessionkv against LRU and the oracle)."""
    keys = (
        "resumed_ttft_p50_s",
        "resumed_ttft_p90_s",
        "task_s_p50",
        "recomputed_tokens",
        "prefix_recomputed_tokens",
        "moved_prefix_recomputed_fraction",
        "moved_ttft_p50_s",
        "cross_start_doc_cached_fraction",
        "cross_start_ttft_p50_s",
        "moved_turns",
        "resumed_routed_s_mean",
        "resumed_engine_s_mean",
    )
    table = {}
    for mode, runs in per_mode.items():
        row = {}
        for k in keys:
            xs = [r[k] for r in runs if r.get(k) is not None]
            row[k] = _median(runs, k)
            row[k + "_spread"] = [float(min(xs)), float(max(xs))] if xs else None
        table[mode] = row
    ratios = {}
    for base in ("lru", "lru+g3"):
        for name, fn in {
            "resumed_ttft_p50_ratio_to_": lambda r: r.get("resumed_ttft_p50_s"),
            "recomputed_ratio_to_": lambda r: r.get("recomputed_tokens"),
            "prefix_recomputed_ratio_to_": lambda r: r.get("prefix_recomputed_tokens"),
            "task_s_p50_ratio_to_": lambda r: r.get("task_s_p50"),
        }.items():
            ratios[name + base] = _median_ratio(per_mode, "sessionkv", base, fn)
    ratios["resumed_ttft_p50_ratio_to_oracle"] = _median_ratio(
        per_mode, "sessionkv", "oracle", lambda r: r.get("resumed_ttft_p50_s")
    )
    ratios["task_s_p50_ratio_to_plain"] = _median_ratio(
        per_mode, "sessionkv", "plain", lambda r: r.get("task_s_p50")
    )
    ratios["moved_prefix_recomputed_fraction"] = table.get("sessionkv", {}).get(
        "moved_prefix_recomputed_fraction"
    )
    return {"modes": table, **ratios}


def _median_ratio(per_mode: dict[str, list[dict]], a: str, b: str, fn) -> float | None:
    """The median over rounds of (a's figure / b's figure) within one round
    (runs are interleaved, so a round's runs saw the same machine)."""
    xs = [_ratio(fn(ra), fn(rb)) for ra, rb in zip(per_mode.get(a, ()), per_mode.get(b, ()))]
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None
