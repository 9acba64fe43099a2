"""One engine as the Retain ranking (``retains.SessionHints``) sees it, and
the hints that leave it: ``EngineView`` keeps the engine's shadow caches
(one per strategy under ``auto``), the ``Selector`` that follows the best,
the queue of Retains waiting to be sent (one entry per session and per
router priority group) and the local token bucket that paces them at
``RATE_SHARE`` of the engine's hint rate. ``Send`` and ``End`` are what the
ranking returns.

Threading: none; one caller (``SessionHints``'s).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from sessionkv.hints import Action, hint_action
from sessionkv.router.config import HintPolicy
from sessionkv.router.shadow import Selector, ShadowCache

ROUTER_OWNER = "sessionkv-router"  # the owner of router-held Retains (shared prefixes, heads)
# How live sessions are ranked, and with "+shared" whether the router also
# holds shared prefixes and ended heads itself.
STRATEGIES = ("recency+shared", "density+shared", "recency", "density", "plain")
RATE_SHARE = 0.8  # of an engine's hint rate the Retains use
RERANK_STEPS = 8  # priority steps (4x its density) that re-send an idle session
PRESSURE_TICKS = 10  # ticks a retained eviction keeps re-ranking step by step


def reranked(sent: int, p: int, steps: int) -> bool:
    """Whether an idle session's Retain at ``sent`` (-1, -2: none yet) is
    re-sent at ``p``: on a move to or from plain, or by ``steps``."""
    return sent < 0 or (p == 0) != (sent == 0) or abs(p - sent) >= steps


def router_holds(strategy: str) -> bool:
    """Whether ``strategy`` has the router Retain shared prefixes and heads."""
    return strategy.endswith("+shared")


class Send(NamedTuple):
    """Control-channel hints for ``worker``, in one envelope for ``session``."""

    worker: str
    session: str
    actions: list[dict[str, Any]]


class End(NamedTuple):
    """End ``session`` on ``worker`` (its pins and retains go)."""

    worker: str
    session: str


Out = Send | End


@dataclass
class QueuedRetain:
    """A queued Retain: of ``session`` up to ``boundary``, or of ``keys``
    (router-owned, for ``ttl_s``)."""

    session: str
    priority: int
    boundary: bytes | None = None
    keys: list[bytes] | None = None
    ttl_s: float | None = None

    def action(self) -> dict[str, Any]:
        if self.keys is not None:
            return hint_action(
                Action.RETAIN, keys=self.keys, priority=self.priority, ttl_s=self.ttl_s
            )
        return hint_action(
            Action.RETAIN, session_id=self.session, boundary=self.boundary, priority=self.priority
        )


class EngineView:
    """One engine: its shadows, selector, hint queue and counters."""

    def __init__(
        self,
        name: str,
        g2_blocks: int,
        g1_blocks: int,
        hints_per_s: float,
        cfg: HintPolicy,
        now: float,
    ):
        self.name = name
        self.g2_blocks, self.g1_blocks = g2_blocks, g1_blocks
        self.rate = max(1.0, hints_per_s * RATE_SHARE)
        self.tokens = self.rate
        self.stamp = now
        names = STRATEGIES if cfg.strategy == "auto" else (cfg.strategy,)
        self.shadows = (
            {n: ShadowCache(g2_blocks, g1_blocks, cfg.shadow_blocks, ROUTER_OWNER) for n in names}
            if len(names) > 1
            else {}
        )
        self.holders = tuple(n for n in names if router_holds(n))
        self.selector = Selector(names, half_life_refs=64.0 * g2_blocks)
        # (owner, tag) -> the Retain to send; a re-queued entry moves last, so
        # a session's Retain never overtakes the router's re-claim after it
        self.pending: OrderedDict[tuple[str, Any], QueuedRetain] = OrderedDict()
        self.sent = 0
        self.reranked = 0  # session Retains re-sent because their priority changed
        self.requests = 0
        self.first_t: float | None = None
        self._evictions_seen: dict[str, int] = {}
        self._pressed_until: dict[str, float] = {}

    def rerank_steps(self, now: float, tick_s: float) -> dict[str, int]:
        """Per strategy, how far an idle session's priority moves before its
        Retain is re-sent (in that strategy's shadow; the followed one's
        for the engine). Step by step while that strategy's shadow evicted
        blocks sessions Retained within ``PRESSURE_TICKS`` ticks (G2 chooses
        among idle sessions: their order matters); else ``RERANK_STEPS`` (a
        fourfold change of density): within a band, vLLM's LRU order among
        chunks of one priority ranks older sessions first, and a re-send at
        each step took 2-4 hints per turn where every session fitted.
        Without shadows (one strategy configured), step by step."""
        if not self.shadows:
            return {self.selector.current: 1}
        steps = {}
        for name, sh in self.shadows.items():
            if sh.retained_evictions != self._evictions_seen.get(name, 0):
                self._evictions_seen[name] = sh.retained_evictions
                self._pressed_until[name] = now + PRESSURE_TICKS * tick_s
            steps[name] = 1 if now < self._pressed_until.get(name, -math.inf) else RERANK_STEPS
        return steps

    def take(self, now: float) -> bool:
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
