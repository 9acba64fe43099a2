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

from collections import Counter

import msgspec

from replay_sim import SimClock, Worker, key_of
from replay_trace import Trace
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


class SessionRouter(Router):
    """The session policy (bench/README.md, "Hint policy").

    Every block gets a Retain priority that ranks how soon the router expects
    it back (higher = sooner); within a priority the G2 policy keeps LRU
    order. A continuing session's expected next turn comes from its own last
    gap (the population's median gap, learned online, for a first turn) and
    its idle time so far: once idle past the expected gap, the residual wait
    of a heavy-tailed gap is taken as about the idle time itself. A tick
    re-sends Retains whose priority changed. Shared prefixes (blocks more than
    one session has sent) are retained at ``P_SHARED`` for ``SHARED_TTL_S``
    from their last use. Ended sessions are ended: their own blocks become
    plain LRU and go first.
    """

    LIMITS = Limits()
    # expected seconds until the next turn -> priority
    BUCKETS = ((60.0, 5), (180.0, 4), (600.0, 3), (float("inf"), 2))
    P_SHARED = 4
    SHARED_TTL_S = 300.0
    TICK_S = 30.0

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        super().__init__(trace, workers, clock)
        self._first_owner: dict[int, int] = {}
        self._shared: set[int] = set()
        self._last_t: dict[int, float] = {}
        self._gap: dict[int, float] = {}
        self._gaps: list[float] = []
        self._live: dict[int, tuple[int, int]] = {}    # session -> (worker, priority sent)
        self._next_tick = self.TICK_S

    def _typical_gap(self) -> float:
        g = self._gaps
        return sorted(g)[len(g) // 2] if len(g) >= 20 else 120.0

    def _priority(self, s: int, now: float, typical: float) -> int:
        idle = now - self._last_t[s]
        expected = self._gap.get(s, typical)
        wait = expected - idle if idle < expected else idle
        for limit, p in self.BUCKETS:
            if wait < limit:
                return p
        return self.BUCKETS[-1][1]

    def before(self, i: int, now: float) -> None:
        if now < self._next_tick:
            return
        self._next_tick = now + self.TICK_S
        typical = self._typical_gap()
        for s, (w, sent) in list(self._live.items()):
            p = self._priority(s, now, typical)
            if p != sent:
                sid = f"s{s}"
                self.send(w, make_hint(Action.RETAIN, sid, priority=p), sid)
                self._live[s] = (w, p)

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        tr = self.trace
        s = tr.session[i]
        ids = tr.blocks[i]
        if s in self._last_t:
            g = now - self._last_t[s]
            self._gap[s] = g
            self._gaps.append(g)
        self._last_t[s] = now
        # Shared prefix: leading blocks more than one session has sent.
        for b in ids:
            if self._first_owner.setdefault(b, s) != s:
                self._shared.add(b)
        m = 0
        for b in ids:
            if b not in self._shared:
                break
            m += 1
        sid = f"s{s}"
        if tr.continues[i]:
            p = self._priority(s, now, self._typical_gap())
            self.send(w, make_hint(Action.RETAIN, sid, priority=p), sid)
            self._live[s] = (w, p)
        else:
            self._live.pop(s, None)
            self._last_t.pop(s, None)
            self._gap.pop(s, None)
            self.end(s, now)
        if m:
            self.send(w, make_hint(Action.RETAIN, "router", keys=[key_of(b) for b in ids[:m]],
                                   priority=self.P_SHARED, ttl_s=self.SHARED_TTL_S), "router")


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

    def _priority(self, s: int, now: float, typical: float) -> int:
        wait = self._next_t[s] - now
        for limit, p in self.BUCKETS:
            if wait < limit:
                return p
        return self.BUCKETS[-1][1]


def make_router(policy: str):
    """(router class or None, executor limits or None) for a G2 policy name."""
    if policy == "session-oracle":
        return OracleGapRouter, OracleGapRouter.LIMITS
    if policy == "naive":
        return NaiveRouter, NaiveRouter.LIMITS
    if policy == "session":
        return SessionRouter, SessionRouter.LIMITS
    return None, None
