"""Mooncake-format traces for the trace replay (``bench/replay.py``).

A trace is one JSON object per line: ``timestamp`` (ms from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per
512-token block of the prompt. Ids are chained: equal ids mean equal content
*and* equal prefix, so an id names its whole prefix.

``load_trace`` parses a trace once into a ``Trace`` that every simulated run
shares: per request its block ids, token weights, reconstructed session, turn
number and whether the session continues, plus, per block reference, the
index of the next request that uses the same block (what the offline
reference needs).

Sessions are rebuilt from the hash chains alone, as a router could: request B
continues request A when A's *full* blocks are a prefix of B's blocks. A's last
block, when partial, is excluded: it changes id once it fills, so B never
repeats it. A prefix that more than one session has sent (a system prompt)
identifies no session and is never matched as one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import make_offload_key

BLOCK_TOKENS = 512
NEVER = np.iinfo(np.int64).max  # next use of a block that is never used again
MAX_CHILDREN = 32  # a block followed by more distinct blocks is a shared prefix


def key_of(block_id: int) -> bytes:
    """The OffloadKey of a trace block: its id as an 8-byte hash, KV group 0."""
    return make_offload_key(block_id.to_bytes(8, "big"), 0)


class SimClock:
    """Trace time in seconds, injected wherever the real classes read a clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Trace:
    """A parsed trace, requests in timestamp order (stable).

    Per request ``i``: ``blocks[i]`` (hash ids, root first), ``tokens[i]``
    (token weight of each block: 512, the last one ``input_length`` minus the
    rest), ``t[i]`` (seconds), ``session[i]`` (reconstructed session number),
    ``turn[i]`` (0 for a session's first request), ``continues[i]`` (the
    session has a later request: what an agent framework or chat frontend
    knows when a turn ends), ``next_use[i]`` (per block, the index of the next
    request that uses it, ``NEVER`` if none).
    """

    blocks: list[list[int]]
    tokens: list[list[int]]
    t: list[float]
    input_length: list[int]
    output_length: list[int]
    session: list[int]
    turn: list[int]
    continues: list[bool]
    next_use: list[list[int]]
    n_sessions: int
    name: str = ""

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def total_tokens(self) -> int:
        return sum(self.input_length)

    @property
    def total_blocks(self) -> int:
        return sum(map(len, self.blocks))

    def stats(self) -> dict:
        """Facts about the trace: sessions, turns, the hit ceiling of an infinite cache."""
        per = np.bincount(np.asarray(self.session, np.int64), minlength=self.n_sessions)
        seen: set[int] = set()
        hit_blocks = hit_tokens = 0
        for blocks, toks in zip(self.blocks, self.tokens):
            for b, w in zip(blocks, toks):
                if b in seen:
                    hit_blocks += 1
                    hit_tokens += w
                else:
                    seen.add(b)
        return {
            "requests": len(self),
            "sessions": self.n_sessions,
            "multi_turn_sessions": int((per > 1).sum()),
            "multi_turn_requests": int(per[per > 1].sum()),
            "block_refs": self.total_blocks,
            "unique_blocks": len(seen),
            "infinite_cache_block_hit_ratio": hit_blocks / max(1, self.total_blocks),
            "infinite_cache_token_hit_ratio": hit_tokens / max(1, self.total_tokens),
        }


def parse_rows(rows: list[dict], name: str = "") -> Trace:
    """Build a ``Trace`` from decoded trace rows (see the module docstring)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i]["timestamp"])
    rows = [rows[i] for i in order]
    blocks, tokens, t, inl, outl = [], [], [], [], []
    session, turn = [], []
    tips: dict[int, int] = {}  # last id of a request's full blocks -> its session
    turns_of: list[int] = []  # per session: requests so far
    first_owner: dict[int, int] = {}  # block id -> first session that sent it
    shared: set[int] = set()  # block ids sent by more than one session
    # Blocks many different blocks follow (a system prompt, a popular
    # document) name no session either, even when one session sent them
    # first: else a short first request would chain every later one to it.
    children: dict[int, set[int]] = {}
    for r in rows:
        ids = r["hash_ids"]
        for a, b in zip(ids, ids[1:]):
            kids = children.setdefault(int(a), set())
            if len(kids) <= MAX_CHILDREN:
                kids.add(int(b))
    for r in rows:
        ids = [int(h) for h in r["hash_ids"]]
        n_in = int(r["input_length"])
        if len(ids) * BLOCK_TOKENS < n_in:
            raise ValueError(f"input_length {n_in} needs more than {len(ids)} blocks")
        w = [BLOCK_TOKENS] * len(ids)
        if ids:
            w[-1] = n_in - BLOCK_TOKENS * (len(ids) - 1)
        # The deepest earlier request whose full blocks are a prefix of ours. A
        # chained id names its whole prefix, so one lookup per depth suffices.
        # A prefix that several sessions sent (the system prompt every request
        # starts with) identifies no session: matching it would chain the
        # whole trace into one "session".
        s = None
        for k in range(len(ids), 0, -1):
            s = tips.get(ids[k - 1])
            if (
                s is not None
                and ids[k - 1] not in shared
                and len(children.get(ids[k - 1], ())) <= MAX_CHILDREN
            ):
                break
            s = None
        if s is None:
            s = len(turns_of)
            turns_of.append(0)
        for b in ids:
            if first_owner.setdefault(b, s) != s:
                shared.add(b)
        turn.append(turns_of[s])
        turns_of[s] += 1
        session.append(s)
        full = min(len(ids), n_in // BLOCK_TOKENS)
        if full and ids[full - 1] not in shared:
            tips[ids[full - 1]] = s
        blocks.append(ids)
        tokens.append(w)
        t.append(float(r["timestamp"]) / 1000.0)
        inl.append(n_in)
        outl.append(int(r.get("output_length", 0)))
    n = len(rows)
    continues = [False] * n
    last_of: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        continues[i] = session[i] in last_of
        last_of.setdefault(session[i], i)
    next_use: list[list[int]] = [[]] * n
    later: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        ids = blocks[i]
        next_use[i] = [later.get(b, NEVER) for b in ids]
        for b in ids:
            later[b] = i
    return Trace(
        blocks, tokens, t, inl, outl, session, turn, continues, next_use, len(turns_of), name
    )


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format JSONL trace (the first ``limit`` requests if given)."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return parse_rows(rows, Path(path).name)
