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

from replay_sim import SimClock, Worker
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
    """The session policy (bench/README.md, "Hint policy")."""

    LIMITS = Limits()
    P_SESSION = 2
    P_SHARED = 3

    def __init__(self, trace: Trace, workers: list[Worker], clock: SimClock):
        super().__init__(trace, workers, clock)
        self._first_owner: dict[int, int] = {}
        self._shared: set[int] = set()

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        tr = self.trace
        s = tr.session[i]
        ids = tr.blocks[i]
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
            self.send(w, make_hint(Action.RETAIN, sid, priority=self.P_SESSION), sid)
        else:
            self.end(s, now)
        if m:
            from replay_sim import key_of
            self.send(w, make_hint(Action.RETAIN, "router", keys=[key_of(b) for b in ids[:m]],
                                   priority=self.P_SHARED), "router")


def make_router(policy: str):
    """(router class or None, executor limits or None) for a G2 policy name."""
    if policy == "naive":
        return NaiveRouter, NaiveRouter.LIMITS
    if policy == "session":
        return SessionRouter, SessionRouter.LIMITS
    return None, None
