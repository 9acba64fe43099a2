"""Router-side hint policies for the trace replay.

A router knows only what it has seen: the hash chains of past requests (so
sessions and shared prefixes), when each session's turns came, how many turns
it had, and, at a turn's end, whether the session continues (an agent
framework knows whether its task is done; a chat frontend whether the tab is
open). Nothing about the future of other sessions, nor when a session's next
turn comes. Hints are built as a router builds them (``sessionkv.hints``
JSON envelopes, parsed back as the engine parses them), marked signed as
control-channel hints are, and executed by the real ``HintExecutor``.

``naive-unbounded``: Pin every session that continues, until its next turn
(no quota, no TTL clip); end the others (their pins and retains go, their
blocks are ordinary LRU and go first). ``naive``: the same under the
engine's default ``Limits``.

``session``: the policy ``sessionkv router`` ships (``PolicyRouter``, a thin
adapter over ``sessionkv.router.hinting``); see bench/README.md.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Protocol

import msgspec
from replay_trace import BLOCK_TOKENS, SimClock, Trace

from sessionkv.config import Limits
from sessionkv.engine.executor import HintExecutor
from sessionkv.hints import Action, KvHint, envelope, hint_action, parse_envelope
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.router.config import HintPolicy
from sessionkv.router.hinting import End, HintPlanner


class Worker(Protocol):
    """What a router reaches of a simulated engine (``replay_sim.Worker``):
    the product's executor and index, as the control channel would."""

    executor: HintExecutor
    index: SessionPrefixIndex
    g2_blocks: int


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
        # (trace time, worker, hints) per delivery: hints and session ends executed,
        # for replay_time (taken and cleared by the simulator)
        self.work_log: list[tuple[float, int, int]] = []
        self.work_n = 0
        self.work_s = 0.0  # wall time the executors spent on them here
        self._visited: dict[int, set[int]] = {}

    def before(self, i: int, now: float) -> None:
        """Trace time reached request ``i``."""

    def start(self, i: int, w: int, now: float, keys: list[bytes]) -> None:
        """Request ``i`` (its block keys ``keys``) goes to worker ``w``, before it is served."""

    def after(self, i: int, w: int, now: float) -> None:
        """Request ``i`` finished on worker ``w``: the turn ended."""
        self._visited.setdefault(self.trace.session[i], set()).add(w)

    def send(self, w: int, hint: KvHint, session: str) -> None:
        t0 = time.perf_counter()
        out = self.workers[w].executor.execute(hint, session, client=session)
        self.work_s += time.perf_counter() - t0
        self.worked(w, 1)
        self.outcomes[f"{hint.action.value}:{out.status.value}"] += 1

    def worked(self, w: int, n: int) -> None:
        self.work_log.append((self.clock(), w, n))
        self.work_n += n

    def end(self, s: int, now: float) -> None:
        """The session is done: end it wherever it went (pins and retains go)."""
        sid = f"s{s}"
        for w in self._visited.pop(s, ()):
            wk = self.workers[w]
            t0 = time.perf_counter()
            wk.executor.release(sid)
            wk.index.end_session(sid, now)
            self.work_s += time.perf_counter() - t0
            self.worked(w, 1)
            self.outcomes["end_session"] += 1


class NaiveRouter(Router):
    """Protect every continuing session until its next turn; end the others."""

    UNBOUNDED = Limits(
        max_ttl_s=1e9, pin_fraction_session=1.0, pin_fraction_global=1.0, hints_per_s_per_client=1e9
    )

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        s = self.trace.session[i]
        if self.trace.continues[i]:
            sid = f"s{s}"
            self.send(w, make_hint(Action.PIN, sid, ttl_s=1e9), sid)
        else:
            self.end(s, now)


TICK_S = 1.0  # router/app.py's _tick loop: policy.tick() once a second


class PolicyRouter(Router):
    """The shipped router policy (``sessionkv.router.hinting.HintPlanner``,
    the class ``sessionkv router`` runs) on trace time: a thin adapter that
    tells it what the router sees and delivers its hints to the real
    ``HintExecutor`` under the router's client id and rate bucket, as the
    control channel does. A turn after which the session continues is a
    tool-call signal; its last turn ends the session."""

    LIMITS = Limits()
    CLIENT = "control:router"

    def __init__(
        self,
        trace: Trace,
        workers: list[Worker],
        clock: SimClock,
        config: HintPolicy = HintPolicy(),
    ):
        super().__init__(trace, workers, clock)
        self.policy = HintPlanner(config, clock)
        self._next_tick: float | None = None  # from the first request on
        for w, wk in enumerate(workers):
            self.policy.add_engine(
                str(w), wk.g2_blocks, wk.g1.capacity, self.LIMITS.hints_per_s_per_client
            )

    def before(self, i: int, now: float) -> None:
        # As ``sessionkv router`` does: tick every TICK_S (it drains the paced
        # hints; re-ranks every tick_s), on trace time up to this request.
        t = now if self._next_tick is None else self._next_tick
        while t <= now:
            self.clock.now = t
            self.deliver(self.policy.tick())
            t += TICK_S
        self._next_tick = t
        self.clock.now = now

    def start(self, i: int, w: int, now: float, keys: list[bytes]) -> None:
        full = min(len(keys), self.trace.input_length[i] // BLOCK_TOKENS)
        # the engine stores the partial last block too (plain: no Retain covers it)
        self.deliver(
            self.policy.turn_started(f"s{self.trace.session[i]}", str(w), keys[:full], keys[full:])
        )

    def after(self, i: int, w: int, now: float) -> None:
        super().after(i, w, now)
        sid = f"s{self.trace.session[i]}"
        if self.trace.continues[i]:
            self.deliver(self.policy.turn_ended(sid))
        else:
            self._visited.pop(self.trace.session[i], None)
            self.deliver(self.policy.session_ended(sid))

    def deliver(self, outs) -> None:
        for o in outs:
            w = int(o.worker)
            wk = self.workers[w]
            if isinstance(o, End):
                t0 = time.perf_counter()
                wk.executor.release(o.session)
                wk.index.end_session(o.session, self.clock())
                self.work_s += time.perf_counter() - t0
                self.worked(w, 1)
                self.outcomes["end_session"] += 1
                continue
            items = [
                h if not isinstance(h, KvHint) else msgspec.structs.replace(h, signed=True)
                for h in parse_envelope(envelope(*o.actions), o.session)
            ]
            t0 = time.perf_counter()
            results = wk.executor.execute_all(items, o.session, client=self.CLIENT)
            self.work_s += time.perf_counter() - t0
            self.worked(w, len(items))
            for out in results:
                status = out.status.value
                self.outcomes[f"{(out.action or '?').removeprefix('kv.')}:{status}"] += 1
                self.policy.outcome(out.action or "?", status)


def make_router(policy: str):
    """(router class or None, executor limits or None) for a G2 policy name."""
    if policy == "naive-unbounded":
        return NaiveRouter, NaiveRouter.UNBOUNDED
    if policy == "naive":
        return NaiveRouter, Limits()
    if policy == "session":
        return PolicyRouter, PolicyRouter.LIMITS
    return None, None
