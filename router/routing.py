"""Routing: which worker a session's turn goes to. Pure: no I/O, no clock.

Session affinity first, then KV overlap, then load: a session stays on its
worker until that worker carries ``max_load`` requests (running + waiting)
and another healthy worker carries fewer and is under ``max_load``; then it
moves. A new or moving session goes to the healthy worker under
``max_load`` (all healthy ones when none is) that holds the most of its
prompt's prefix (``scores``: ``overlap_scores``, > 0), else to the
least-loaded one; ties broken by load, then by a counter the replicas share.
A session whose worker is unhealthy moves the same way. A draining worker
takes no turn while another healthy one can.

What a move sends (Share, Prefetch, the end on the old worker) is the hint
planner's (``hinting.HintPlanner.move``), not routing's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sessionkv.router.overlap import BlockHasher, OverlapIndex, score


class NoWorker(RuntimeError):
    """No healthy worker to send a turn to."""


class Loaded(Protocol):
    """What routing reads of a worker."""

    name: str
    healthy: bool
    draining: bool

    @property
    def load(self) -> float: ...


class Scored(Protocol):
    """What overlap scoring reads of a worker: its hasher (None: no overlap
    routing there) and the index of what its event stream says it holds."""

    name: str
    healthy: bool
    hasher: BlockHasher | None
    index: OverlapIndex


def choose(
    workers: Sequence[Loaded],
    current: str | None,
    max_load: int,
    tie_break: int = 0,
    scores: Mapping[str, float] | None = None,
) -> str:
    """The worker a session's turn goes to (see the module docstring)."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoWorker("no healthy worker")
    # A draining worker takes no turn while another can (its sessions move).
    healthy = [w for w in healthy if not w.draining] or healthy
    least = min(w.load for w in healthy)
    cur = next((w for w in healthy if w.name == current), None)
    if cur is not None:
        if cur.load < max_load or least >= cur.load or least >= max_load:
            return cur.name
    pool = [w for w in healthy if w.load < max_load] or healthy
    scores = scores or {}
    top = max(scores.get(w.name, 0.0) for w in pool)
    if top > 0:
        pool = [w for w in pool if scores.get(w.name, 0.0) == top]
    least = min(w.load for w in pool)
    best = [w for w in pool if w.load == least]
    return best[tie_break % len(best)].name


def token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """A completion's ``prompt`` when it is token ids (non-empty), else None."""
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    return None


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The body's ``cache_salt`` when it is a string (it enters block hashes)."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


def overlap_scores(
    workers: Sequence[Scored], tokens: Sequence[int], salt: str | None, g2_weight: float
) -> dict[str, float]:
    """Each healthy worker's overlap score for a token-id prompt (workers
    without a hasher are left out); each distinct hasher hashes it once."""
    keys: dict[BlockHasher, list[bytes]] = {}
    out = {}
    for w in workers:
        if w.hasher is None or not w.healthy:
            continue
        if w.hasher not in keys:
            keys[w.hasher] = w.hasher.keys(tokens, salt)
        out[w.name] = score(w.index.held(keys[w.hasher]), g2_weight)
    return out
