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

import bisect
import math
from collections import Counter
from typing import Protocol

import msgspec
import numpy as np

from replay_trace import BLOCK_TOKENS, SimClock, Trace, key_of
from sessionkv.config import Limits
from sessionkv.connectors.hint_executor import HintExecutor
from sessionkv.hints import Action, KvHint, envelope, hint_action, parse_envelope
from sessionkv.index.prefix_index import SessionPrefixIndex


class Worker(Protocol):
    """What a router reaches of a simulated engine (``replay_sim.Worker``):
    the product's executor and index, as the control channel would."""

    executor: HintExecutor
    index: SessionPrefixIndex


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
                 prior_weight: float = 10.0, prior_never: float = 0.0):
        mid = np.sqrt(self.EDGES[:-1] * self.EDGES[1:])
        w = np.exp(-0.5 * ((np.log(mid) - np.log(prior_median_s)) / prior_sigma) ** 2)
        self.counts = prior_weight * w / w.sum()
        self.never = prior_never       # mass that never came back
        self.seen = 0
        self._table: list[float] | None = None
        self._dirty = True
        self._edges = self.EDGES.tolist()

    def _bin(self, seconds: float) -> int:
        k = bisect.bisect_right(self._edges, seconds) - 1
        return min(max(k, 0), len(self.counts) - 1)

    def add(self, gap_s: float) -> None:
        """One more observed gap between two turns of a session."""
        self.counts[self._bin(gap_s)] += 1.0
        self.seen += 1
        self._dirty = True

    def add_never(self) -> None:
        """One more wait that ended without a return (given up on)."""
        self.never += 1.0
        self._dirty = True

    def refresh(self) -> None:
        """Recompute the density table from what was added since the last
        refresh (the router calls this once per tick: it is O(bins^2))."""
        if self._dirty or self._table is None:
            self._table = self._densities().tolist()
            self._dirty = False

    def _densities(self) -> np.ndarray:
        c = self.counts
        width = np.diff(self.EDGES)
        # S[j]: mass of gaps longer than EDGES[j]; inside a bin, returns are
        # spread uniformly, so the mass still held decays linearly.
        S = c.sum() + self.never - np.concatenate([[0.0], np.cumsum(c)])
        held = width * (S[:-1] + S[1:]) / 2.0
        out = np.zeros(len(c))
        for j in range(len(c)):
            if S[j] > 1e-9:
                hits = np.cumsum(c[j:])
                out[j] = float((hits / np.maximum(np.cumsum(held[j:]), 1e-12)).max())
        return out      # 0 where nothing is left to come back

    def density(self, idle_s: float) -> float:
        """Expected returns per held-second of a session idle for ``idle_s``."""
        if self._table is None:
            self.refresh()
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
    blocks that will save the most prefill per block of G2. Densities come
    from ``GapModel``s the router learns online from what it has seen.

    - A continuing session's own blocks (its prefix up to its last full
      block) are Retained, owned by the session, at the density of its next
      turn given its idle time. A tick re-sends the Retains whose priority
      changed.
    - Shared prefixes (leading blocks more than one session has sent) are
      Retained by key, owned by the router, so that no session's end releases
      them, at the highest density that claims them: their own (the next new
      session through them, by how many sessions came so far and how long
      since the last) or any live session's through them.
    - Ended sessions are ended: their own blocks become plain LRU and go
      first, except their head (the first ``ENDED_HEAD_FRACTION`` of their
      blocks), which later sessions sometimes branch from (a regenerated or
      edited first message, another question on the same document): the
      router Retains it for ``WATCH_S`` at the density such heads have had so
      far, far below a live session's, so it only outlives plain blocks.
    """

    LIMITS = Limits()
    TICK_S = 30.0
    WATCH_S = 600.0                # router-owned Retains' TTL (the executor's maximum)
    SHARED_CLASSES = (2, 3, 5, 9)  # sessions so far through a shared block -> its model
    ENDED_HEAD_FRACTION = 0.25

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        super().__init__(trace, workers, clock)
        self._first: dict[int, tuple[int, float]] = {}   # block -> (first session, time)
        # shared block -> [sessions through it, last new session's arrival,
        # workers it went to, (priority, time) last sent]
        self._shared: dict[int, list] = {}
        self._last_t: dict[int, float] = {}
        self.gaps = GapModel()
        self.shared_gaps = [GapModel(300.0, 1.5, 5.0, 5.0) for _ in self.SHARED_CLASSES]
        # live session -> (worker, last full block's key, priority sent, shared head)
        self._live: dict[int, tuple[int, bytes, int, tuple[int, ...]]] = {}
        self._next_tick = self.TICK_S
        # Ended sessions' heads: block -> end of its watch; how many blocks were
        # watched and how many a later session reused (prior: 1 in 100).
        self._heads: dict[int, float] = {}
        self._heads_watched = 100
        self._heads_reused = 1

    def _priority(self, s: int, now: float) -> int:
        return density_priority(self.gaps.density(now - self._last_t[s]))

    def _shared_model(self, n: int) -> GapModel:
        return self.shared_gaps[max(0, bisect.bisect_right(self.SHARED_CLASSES, n) - 1)]

    def _retain_session(self, s: int, w: int, boundary: bytes, p: int,
                        head: tuple[int, ...]) -> None:
        """Retain the session's prefix up to ``boundary`` (its last full block)
        at priority ``p``. Up to the boundary only: the turn's partial last
        block changes id when it fills, and earlier turns' partial blocks are
        dead leaves of the session, so neither is ever reused. The shared
        head it covers is claimed back by the router right after."""
        sid = f"s{s}"
        self.send(w, make_hint(Action.RETAIN, sid, session_id=sid, boundary=boundary,
                               priority=p), sid)
        self._live[s] = (w, boundary, p, head)

    def _retain_shared(self, blocks, now: float, force: bool) -> None:
        """Router-owned Retains of shared ``blocks`` on every worker holding
        them, each at the highest density claiming it; unchanged ones only
        when ``force`` or half their TTL has passed (one hint per worker and
        priority: the router's rate limit applies)."""
        claim: dict[int, int] = {}
        for _, _, p, head in self._live.values():
            for b in head:
                if claim.get(b, 0) < p:
                    claim[b] = p
        groups: dict[tuple[int, int], list[bytes]] = {}
        for b in blocks:
            st = self._shared[b]
            d = self._shared_model(len(st[0])).density(now - st[1])
            p = max(density_priority(d), claim.get(b, 0))
            sent_p, sent_t = st[3]
            if not force and p == sent_p and now - sent_t < self.WATCH_S / 2:
                continue
            st[3] = (p, now)
            for w in st[2]:
                groups.setdefault((w, p), []).append(key_of(b))
        for (w, p), keys in groups.items():
            self.send(w, make_hint(Action.RETAIN, "router", keys=keys, priority=p,
                                   ttl_s=self.WATCH_S), "router")

    def _retain_head(self, w: int, blocks: list[int], now: float) -> None:
        """Watch an ended session's private head and Retain it, router-owned,
        at the density ended heads have had (reuses per block-second)."""
        if not blocks:
            return
        until = now + self.WATCH_S
        for b in blocks:
            self._heads[b] = until
        self._heads_watched += len(blocks)
        d = self._heads_reused / (self._heads_watched * self.WATCH_S)
        self.send(w, make_hint(Action.RETAIN, "router", keys=[key_of(b) for b in blocks],
                               priority=density_priority(d), ttl_s=self.WATCH_S), "router")

    def before(self, i: int, now: float) -> None:
        if now < self._next_tick:
            return
        self._next_tick = now + self.TICK_S
        for m in [self.gaps, *self.shared_gaps]:
            m.refresh()
        self._heads = {b: t for b, t in self._heads.items() if t > now}
        heads: set[int] = set()
        for s, (w, boundary, sent, head) in list(self._live.items()):
            p = self._priority(s, now)
            if p != sent:
                self._retain_session(s, w, boundary, p, head)
                heads.update(head)
        # A shared block no new session came through for WATCH_S: given up
        # on (a "never" for its model); its Retain lapses to plain LRU.
        for b in [b for b, st in self._shared.items() if now - st[1] > self.WATCH_S]:
            self._shared_model(len(self._shared[b][0])).add_never()
            del self._shared[b]
        # Heads whose session Retain was just re-sent are claimed back first.
        self._retain_shared([b for b in heads if b in self._shared], now, force=True)
        self._retain_shared(list(self._shared), now, force=False)

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
                st = self._shared[b] = [{first[0]}, first[1], set(), (0, 0.0)]
                if self._heads.pop(b, 0.0) > now:
                    self._heads_reused += 1
            if s not in st[0]:
                if len(st[0]) > 1:
                    self._shared_model(len(st[0])).add(now - st[1])
                st[0].add(s)
                st[1] = now
            st[2].add(w)
            m += 1
        for b in ids[m + 1:]:
            self._first.setdefault(b, (s, now))
        head = tuple(ids[:m])
        full = min(len(ids), tr.input_length[i] // BLOCK_TOKENS)
        if tr.continues[i] and full:
            self._retain_session(s, w, key_of(ids[full - 1]), self._priority(s, now), head)
        else:
            self._live.pop(s, None)
            if not tr.continues[i]:
                self._last_t.pop(s, None)
                self.end(s, now)
                self._retain_head(w, ids[m:max(m, math.ceil(full * self.ENDED_HEAD_FRACTION))],
                                  now)
        if m:
            self._retain_shared(head, now, force=True)


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
