"""Router-side hint policies for the trace replay.

A router knows only what it has seen: the hash chains of past requests (so
sessions and shared prefixes), when each session's turns came, how many turns
it had, and, at a turn's end, whether the session continues (an agent
framework knows whether its task is done; a chat frontend whether the tab is
open). Nothing about the future of other sessions, nor when a session's next
turn comes. Hints are built as a router builds them (``sessionkv.hints``
JSON envelopes, parsed back as the engine parses them), marked signed as
control-channel hints are, and executed by the real ``HintExecutor``.

``naive``: Pin every session that continues, until its next turn (no quota,
no TTL clip); end the others (their pins and retains go, their blocks are
ordinary LRU and go first).

``session``: see ``SessionRouter`` and bench/README.md.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import numpy as np

from replay_sim import SimClock, Worker, key_of
from replay_trace import BLOCK_TOKENS, Trace
from sessionkv.config import Limits
from sessionkv.hints import Action, KvHint, envelope, hint_action, parse_envelope


def make_hint(action: Action, session: str, **kw) -> KvHint:
    """One hint as the router sends it on the control channel (signed)."""
    (h,) = parse_envelope(envelope(hint_action(action, **kw)), session)
    if not isinstance(h, KvHint):
        raise ValueError(f"router built an unparsable hint: {h}")
    return msgspec.structs.replace(h, signed=True)


class Router:
    """Base: tracks which workers each session visited; sends nothing."""

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        self.trace = trace
        self.workers = workers
        self.clock = clock
        self.outcomes: Counter = Counter()
        self._visited: dict[int, set[int]] = {}

    def before(self, i: int, now: float) -> None:
        """Trace time reached request ``i`` (before it is served)."""

    def after(self, i: int, w: int, now: float) -> None:
        """Request ``i`` finished on worker ``w``: the turn ended."""
        self._visited.setdefault(self.trace.session[i], set()).add(w)

    def send(self, w: int, hint: KvHint, session: str) -> None:
        out = self.workers[w].executor.execute(hint, session, client=session)
        self.outcomes[f"{hint.action.value}:{out.status.value}"] += 1

    def end(self, s: int, now: float) -> None:
        """The session is done: end it wherever it went (pins and retains go)."""
        sid = f"s{s}"
        for w in self._visited.pop(s, ()):
            wk = self.workers[w]
            wk.executor.release(sid)
            wk.index.end_session(sid, now)
            self.outcomes["end_session"] += 1


class NaiveRouter(Router):
    """Protect every continuing session until its next turn; end the others."""

    LIMITS = Limits(max_ttl_s=1e9, pin_fraction_session=1.0, pin_fraction_global=1.0,
                    hints_per_s_per_client=1e9)

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        s = self.trace.session[i]
        if self.trace.continues[i]:
            sid = f"s{s}"
            self.send(w, make_hint(Action.PIN, sid, ttl_s=1e9), sid)
        else:
            self.end(s, now)


class GapModel:
    """The router's online estimate of how soon an idle continuing session
    returns, learned from the inter-turn gaps it has seen so far.

    A histogram of observed gaps on log-spaced bins (started from a weak
    log-normal prior so that it answers before any gap is seen) gives, for an
    idle time ``t``, the *hit density* of a block held from now on: the best,
    over holding horizons ``h``, of P(the session returns within ``h`` | idle
    ``t``) divided by the expected block-seconds spent holding it until it
    returns or ``h`` runs out. This is the quantity an eviction order should
    rank by when every block of a returning session is reused (LHD, Beckmann
    et al., NSDI'18); it is not monotone in idle time for a log-normal-ish
    gap distribution (a session idle for a minute is likelier to return in
    the next minute than one that has just finished its turn).
    """

    EDGES = np.geomspace(1.0, 20_000.0, 73)      # seconds; 4 bins per doubling

    def __init__(self, prior_median_s: float = 120.0, prior_sigma: float = 1.0,
                 prior_weight: float = 10.0):
        mid = np.sqrt(self.EDGES[:-1] * self.EDGES[1:])
        w = np.exp(-0.5 * ((np.log(mid) - np.log(prior_median_s)) / prior_sigma) ** 2)
        self.counts = prior_weight * w / w.sum()
        self.seen = 0
        self._table: np.ndarray | None = None

    def _bin(self, seconds: float) -> int:
        k = int(np.searchsorted(self.EDGES, max(seconds, 1.0), side="right")) - 1
        return min(max(k, 0), len(self.counts) - 1)

    def add(self, gap_s: float) -> None:
        """One more observed gap between two turns of a session."""
        self.counts[self._bin(gap_s)] += 1.0
        self.seen += 1
        self._table = None

    def _densities(self) -> np.ndarray:
        c = self.counts
        width = np.diff(self.EDGES)
        # S[j]: mass of gaps longer than EDGES[j]; inside a bin, returns are
        # spread uniformly, so the mass still held decays linearly.
        S = c.sum() - np.concatenate([[0.0], np.cumsum(c)])
        held = width * (S[:-1] + S[1:]) / 2.0
        out = np.zeros(len(c))
        for j in range(len(c)):
            if S[j] > 1e-9:
                hits = np.cumsum(c[j:])
                out[j] = float((hits / np.maximum(np.cumsum(held[j:]), 1e-12)).max())
            elif j:
                out[j] = out[j - 1]
        return out

    def density(self, idle_s: float) -> float:
        """Expected returns per held-second of a session idle for ``idle_s``."""
        if self._table is None:
            self._table = self._densities()
        return float(self._table[self._bin(idle_s)])


def density_priority(density: float) -> int:
    """A Retain priority from a hit density (reuses per second held): four
    steps per doubling (1e-6/s -> 1, 1/s -> 80), so the policy's integer
    order follows the density order and hints change only on a real change;
    0 means "plain" to the policy, hence at least 1."""
    return int(max(1, round(4 * math.log2(max(density, 1e-9) * 1e6))))


class SessionRouter(Router):
    """The session policy (bench/README.md, "Hint policy").

    Every retained block gets a priority from its hit density: how often the
    router expects it to be reused per second it is held, so that
    ``SessionCachePolicy``, which evicts lower priorities first, keeps the
    blocks that will save the most prefill per block of G2.

    - A continuing session's own blocks (its prefix up to its last full
      block) are Retained, owned by the session, at the density of its next
      turn: from the gap distribution learned so far (``GapModel``) and its
      idle time. A tick re-sends the Retains whose priority changed.
    - Shared prefixes (leading blocks more than one session has sent) are
      Retained by key, owned by the router, so that no session's end releases
      them, at the highest density that claims them: their own (distinct
      sessions arriving through them per second, decaying with idle time) or
      any live session's through them. The router re-sends them every tick
      with a TTL of two ticks, so stale ones lapse to plain LRU.
    - Ended sessions are ended: their own blocks become plain LRU and go first.
    """

    LIMITS = Limits()
    TICK_S = 30.0
    SHARED_TTL_S = 2 * TICK_S
    SHARED_MIN_DENSITY = 1e-5      # below this a shared block is let go

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        super().__init__(trace, workers, clock)
        self._first: dict[int, tuple[int, float]] = {}   # block -> (first session, time)
        # shared block -> [sessions through it, first use, last use, workers holding it]
        self._shared: dict[int, list] = {}
        self._last_t: dict[int, float] = {}
        self.gaps = GapModel()
        # live session -> (worker, last full block's key, priority sent, shared head)
        self._live: dict[int, tuple[int, bytes, int, tuple[int, ...]]] = {}
        self._next_tick = self.TICK_S

    def _priority(self, s: int, now: float) -> int:
        return density_priority(self.gaps.density(now - self._last_t[s]))

    def _shared_density(self, b: int, now: float) -> float:
        """Distinct sessions per second that came through shared block ``b``,
        held at most as high as one reuse per idle time since its last use."""
        sessions, first, last, _ = self._shared[b]
        rate = (len(sessions) - 1) / max(last - first, 1.0)
        return 1.0 / (1.0 / rate + (now - last))

    def _retain_session(self, s: int, w: int, boundary: bytes, p: int,
                        head: tuple[int, ...]) -> None:
        """Retain the session's prefix up to ``boundary`` (its last full block)
        at priority ``p``. Up to the boundary only: the turn's partial last
        block changes id when it fills, and earlier turns' partial blocks are
        dead leaves of the session, so neither is ever reused."""
        sid = f"s{s}"
        self.send(w, make_hint(Action.RETAIN, sid, session_id=sid, boundary=boundary,
                               priority=p), sid)
        self._live[s] = (w, boundary, p, head)

    def _retain_shared(self, blocks, now: float) -> None:
        """Router-owned Retains of shared ``blocks`` on every worker holding
        them, each at the highest density claiming it (one hint per worker
        and priority: the router's own rate limit applies)."""
        claim: dict[int, int] = {}
        for w, _, p, head in self._live.values():
            for b in head:
                if claim.get(b, 0) < p:
                    claim[b] = p
        groups: dict[tuple[int, int], list[bytes]] = {}
        for b in blocks:
            d = self._shared_density(b, now)
            p = max(density_priority(d), claim.get(b, 0))
            if d < self.SHARED_MIN_DENSITY and b not in claim:
                continue
            for w in self._shared[b][3]:
                groups.setdefault((w, p), []).append(key_of(b))
        for (w, p), keys in groups.items():
            self.send(w, make_hint(Action.RETAIN, "router", keys=keys, priority=p,
                                   ttl_s=self.SHARED_TTL_S), "router")

    def before(self, i: int, now: float) -> None:
        if now < self._next_tick:
            return
        self._next_tick = now + self.TICK_S
        for s, (w, boundary, sent, head) in list(self._live.items()):
            p = self._priority(s, now)
            if p != sent:
                self._retain_session(s, w, boundary, p, head)
        # After the sessions' Retains, which claim their shared heads too.
        stale = [b for b, st in self._shared.items() if now - st[2] > 1 / self.SHARED_MIN_DENSITY]
        for b in stale:
            del self._shared[b]
        self._retain_shared(list(self._shared), now)

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        tr = self.trace
        s = tr.session[i]
        ids = tr.blocks[i]
        if s in self._last_t:
            self.gaps.add(now - self._last_t[s])
        self._last_t[s] = now
        # Shared prefix: the leading blocks more than one session has sent
        # (a chained id names its whole prefix, so they are a leading run).
        m = 0
        for b in ids:
            first = self._first.setdefault(b, (s, now))
            st = self._shared.get(b)
            if st is None:
                if first[0] == s:
                    break
                st = self._shared[b] = [{first[0]}, first[1], now, set()]
            st[0].add(s)
            st[2] = now
            st[3].add(w)
            m += 1
        head = tuple(ids[:m])
        full = min(len(ids), tr.input_length[i] // BLOCK_TOKENS)
        if tr.continues[i] and full:
            self._retain_session(s, w, key_of(ids[full - 1]), self._priority(s, now), head)
        else:
            self._live.pop(s, None)
            if not tr.continues[i]:
                self._last_t.pop(s, None)
                self.end(s, now)
        if m:
            self._retain_shared(head, now)


class OracleGapRouter(SessionRouter):
    """Diagnostic, not a router policy: ``SessionRouter`` told the true time of
    each session's next turn (future knowledge). The distance between it and
    ``session`` is what not knowing when a session returns costs; between it
    and ``opt``, what the mechanism (G1/G2 split, priorities, LRU within one)
    costs."""

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        super().__init__(trace, workers, clock)
        self._next_t: dict[int, float] = {}
        nxt: dict[int, float] = {}
        self._turn_next: list[float] = [0.0] * len(trace)
        for i in range(len(trace) - 1, -1, -1):
            s = trace.session[i]
            self._turn_next[i] = nxt.get(s, float("inf"))
            nxt[s] = trace.t[i]

    def after(self, i: int, w: int, now: float) -> None:
        self._next_t[self.trace.session[i]] = self._turn_next[i]
        super().after(i, w, now)

    def _priority(self, s: int, now: float) -> int:
        return density_priority(1.0 / max(1.0, self._next_t[s] - now))


def make_router(policy: str):
    """(router class or None, executor limits or None) for a G2 policy name."""
    if policy == "session-oracle":
        return OracleGapRouter, OracleGapRouter.LIMITS
    if policy == "naive":
        return NaiveRouter, NaiveRouter.LIMITS
    if policy == "session":
        return SessionRouter, SessionRouter.LIMITS
    return None, None
