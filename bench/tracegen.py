"""Synthetic traces in the Mooncake format, from documented parameters.

    python bench/tracegen.py bench/traces/agentic.yaml --out agentic.jsonl

Writes one JSON object per request: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block of the
prompt, chained: equal ids mean equal content and equal prefix, as in the
Mooncake traces ``bench/replay.py`` reads). Everything is drawn from
``random.Random(seed)``: one parameter file gives one trace.

A session arrives (Poisson, ``arrival_per_s``), starts from the system prompt
and, with ``documents.p_use``, one document prefix (Zipf popularity), and
runs a number of turns (geometric, mean ``turns_mean``). Each later turn's
prompt is the previous prompt, its output and a new user message; the wait
before it is drawn from a mixture of log-normal gaps (``gaps``: short tool
gaps, long human ones). With ``branch_p`` a turn instead branches: it
repeats an earlier turn's prompt (a retry or an edited message) and adds a
new message, so its blocks share only that earlier prefix. Parameters::

    seed: 1                     # the trace's random seed
    sessions: 1500              # how many sessions arrive
    arrival_per_s: 0.5          # their arrival rate
    turns_mean: 6               # turns per session (geometric, >= 1)
    system_tokens: 1500         # one system prompt every session starts with
    documents: {count: 200, zipf: 1.1, tokens_median: 6000, p_use: 0.3}
    first_user_tokens_median: 400
    user_tokens_median: 150     # each later user message (log-normal, sigma 0.8)
    output_tokens_median: 300   # each answer (log-normal, sigma 0.8)
    gaps:                       # between a turn's end and the next turn
      - {weight: 0.8, median_s: 8, sigma: 0.8}
      - {weight: 0.2, median_s: 240, sigma: 1.0}
    branch_p: 0.05
    max_input_tokens: 131072    # a session that would grow past this ends
    tokens_per_s: 2000          # decode speed: a turn ends output_length / this after it starts
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

BLOCK = 512


@dataclass(frozen=True)
class Gap:
    weight: float
    median_s: float
    sigma: float


@dataclass(frozen=True)
class Documents:
    count: int = 0
    zipf: float = 1.1
    tokens_median: int = 4000
    p_use: float = 0.0


@dataclass(frozen=True)
class Params:
    seed: int = 1
    sessions: int = 1000
    arrival_per_s: float = 0.5
    turns_mean: float = 5.0
    system_tokens: int = 1000
    documents: Documents = Documents()
    first_user_tokens_median: int = 400
    user_tokens_median: int = 150
    output_tokens_median: int = 300
    gaps: tuple[Gap, ...] = (Gap(1.0, 30.0, 1.0),)
    branch_p: float = 0.0
    max_input_tokens: int = 131_072
    tokens_per_s: float = 2000.0

    @classmethod
    def load(cls, path: str) -> Params:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in fields(cls)}
        for k in doc:
            if k not in known:
                raise ValueError(f"{path}: unknown key {k!r} (known: {', '.join(sorted(known))})")
        kw = dict(doc)
        for f in fields(cls):
            default = getattr(cls, f.name, None)
            if (
                f.name in kw
                and isinstance(default, (int, float))
                and (isinstance(kw[f.name], bool) or not isinstance(kw[f.name], (int, float)))
            ):
                raise ValueError(f"{path}: {f.name} must be a number, got {kw[f.name]!r}")
        if "documents" in kw:
            kw["documents"] = Documents(**kw["documents"])
        if "gaps" in kw:
            kw["gaps"] = tuple(Gap(**g) for g in kw["gaps"])
            if not kw["gaps"] or any(g.weight <= 0 or g.median_s <= 0 for g in kw["gaps"]):
                raise ValueError(f"{path}: gaps need positive weights and medians")
        return cls(**kw)


@dataclass
class _Blocks:
    """Chained block ids for token streams made of segments (unique content
    pieces): a block's id names its whole prefix."""

    ids: dict = field(default_factory=dict)

    def of(self, segments: list[tuple[int, int]]) -> list[int]:
        """Block ids of a prompt given as (segment id, tokens) pieces."""
        out: list[int] = []
        parent, piece, filled = -1, [], 0
        for seg, n in segments:
            start = 0
            while start < n:
                take = min(n - start, BLOCK - filled)
                piece.append((seg, start, start + take))
                filled += take
                start += take
                if filled == BLOCK:
                    parent = self._id(parent, piece)
                    out.append(parent)
                    piece, filled = [], 0
        if piece:
            out.append(self._id(parent, piece))
        return out

    def _id(self, parent: int, piece: list) -> int:
        key = (parent, tuple(piece))
        got = self.ids.get(key)
        if got is None:
            got = self.ids[key] = len(self.ids)
        return got


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def generate(p: Params) -> list[dict]:
    """Every request of the trace, in timestamp order."""
    rng = random.Random(p.seed)
    blocks = _Blocks()
    seg = iter(range(1, 1 << 62))
    system = [(0, p.system_tokens)] if p.system_tokens else []
    docs = [
        (next(seg), max(1, int(_lognormal(rng, p.documents.tokens_median, 0.5))))
        for _ in range(p.documents.count)
    ]
    zipf = [1.0 / (k + 1) ** p.documents.zipf for k in range(len(docs))]
    cum = [sum(zipf[: k + 1]) for k in range(len(zipf))]
    weights = [g.weight for g in p.gaps]
    out = []
    t = 0.0
    for _ in range(p.sessions):
        t += rng.expovariate(p.arrival_per_s)
        prompt = list(system)
        if docs and rng.random() < p.documents.p_use:
            prompt.append(docs[bisect.bisect_left(cum, rng.random() * cum[-1])])
        prompt.append((next(seg), max(1, int(_lognormal(rng, p.first_user_tokens_median, 0.8)))))
        history = [list(prompt)]
        turns = (
            1 + int(math.log(max(rng.random(), 1e-12)) / math.log(1 - 1 / p.turns_mean))
            if p.turns_mean > 1
            else 1
        )
        now = t
        for turn in range(turns):
            n_in = sum(n for _, n in prompt)
            if n_in > p.max_input_tokens:
                break
            n_out = max(1, int(_lognormal(rng, p.output_tokens_median, 0.8)))
            out.append(
                {
                    "timestamp": int(now * 1000),
                    "input_length": n_in,
                    "output_length": n_out,
                    "hash_ids": blocks.of(prompt),
                }
            )
            if turn == turns - 1:
                break
            now += n_out / p.tokens_per_s
            gap = rng.choices(p.gaps, weights)[0]
            now += _lognormal(rng, gap.median_s, gap.sigma)
            user = (next(seg), max(1, int(_lognormal(rng, p.user_tokens_median, 0.8))))
            if len(history) > 1 and rng.random() < p.branch_p:
                prompt = list(rng.choice(history[:-1])) + [user]
            else:
                prompt = prompt + [(next(seg), n_out), user]
            history.append(list(prompt))
    out.sort(key=lambda r: r["timestamp"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", help="a YAML parameter file (bench/traces/*.yaml)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    reqs = generate(Params.load(args.params))
    with open(args.out, "w") as f:
        for r in reqs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(reqs)} requests")


if __name__ == "__main__":
    main()
