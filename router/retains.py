"""Which sessions G2 keeps: what a router sees of sessions, turned into Retains.

``SessionHints`` ranks live sessions, shared prefixes and ended heads per
engine and returns the Retains and session ends that follow (``Send``,
``End``). ``hinting.HintPlanner`` owns it: ``sessionkv router`` runs the
planner against real engines (``app.py`` delivers its output over the
control channel) and ``bench/replay.py`` runs the same planner on trace time
against the real ``HintExecutor`` (``bench/replay_router.py``). It sees only
what a router sees: turn starts (session, engine, the prompt's full-block
keys), turn ends, session ends, and the engines' G2 capacity and hint rate
(their ``hello``); nothing about when a session returns.

What it keeps, on every engine:

- a live session (between turns): Retained, owned by the session, up to its
  prompt's last full block (the partial last block changes key when it
  fills; earlier turns' partial blocks are dead leaves), at a priority the
  current *strategy* gives it, and its first turn's prefix ``HEAD_BOOST``
  steps above that (a return hits a prefix: what grew later is worth
  nothing without its head, so under pressure the growth goes first);
  re-sent when a turn ends and when that priority changes;
- with a ``+shared`` strategy, shared prefixes (leading blocks more than one
  session sent): Retained by key, owned by the router (so no session's end
  releases them), for ``watch_s``, at the highest of their own density (the
  wait for the next new session through them, per popularity class) and the
  rank of any idle session over them; re-claimed right after each session
  Retain that covered them (a later Retain of a key replaces the earlier
  one); and an ended session's head (the first quarter of its blocks: later
  sessions sometimes branch from it), Retained for ``watch_s`` at the reuse
  rate such heads have had;
- an ended session: ended (its pins and retains go, its blocks are plain LRU).

Strategies rank live sessions: ``recency`` (keep every live session, the
longest idle goes first: "keep every continuing session until it returns"),
``density`` (LHD hit density from the learned inter-turn gaps), each with or
without ``+shared``, and ``plain`` (no session Retains: vLLM's LRU). ``auto``
(the default) keeps one ``ShadowCache`` per strategy per engine, sized from
the engine's G1 and G2 and fed the engine's own requests with the
priorities that strategy would send, and follows the strategy whose shadow
hit the most lately (``Selector``); a switch re-sends the live sessions'
Retains, paced.

Hint traffic: hints wait in a per-engine queue (one entry per session and
per router priority group, so bounded by the live sessions) and leave at
most at the engine's per-client rate (a local token bucket at 80 % of it),
batched per session. Nothing is sent twice for the same priority. An idle
session's Retain follows its falling rank step by step only while G2 is
choosing among Retained sessions (its shadow evicted some lately), else
by bands of ``RERANK_STEPS`` (``EngineView.rerank_steps``, per strategy).

Memory: ``max_sessions`` live sessions and ``max_blocks`` first-seen blocks
(least recently seen forgotten first); per engine, shadows of at most
``shadow_blocks`` keys each. Cost per request: O(its blocks) plus the
shadows' evictions; per tick: O(live sessions + shared blocks).

Threading: none; one caller (the router's event loop, or the replay).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessionkv.router.config import HintPolicy
from sessionkv.router.gaps import GapModel, density_priority
from sessionkv.router.retain_queue import (
    ROUTER_OWNER,
    End,
    EngineView,
    Out,
    QueuedRetain,
    Send,
    reranked,
    router_holds,
)
from sessionkv.router.shadow import ShadowCache

SHARED_CLASSES = (2, 3, 5, 9)  # sessions so far through a shared block -> its gap model
HEAD_FRACTION = 0.25  # of an ended session's blocks, watched for branches
HEAD_BOOST = 12  # priority steps a session's first-turn prefix gets over its growth


@dataclass
class _Live:
    worker: str
    keys: list[bytes]  # the last prompt's full blocks
    head: int  # how many leading ones are shared
    last_t: float
    active: bool = True
    sent: int = -1  # priority queued to the engine (-1: none)
    # per router-holding strategy: the priority it claims its shared head at
    claimed: dict[str, int] = field(default_factory=dict)
    first: int = 0  # full blocks of its first turn
    held: bool = False  # a Retain above plain was queued for it
    shadow: dict[str, int] = field(default_factory=dict)  # strategy -> priority in its shadow
    workers: set[str] = field(default_factory=set)


@dataclass
class _Shared:
    sessions: int  # sessions seen through the block
    last_new: float  # when the last new one came
    workers: set[str]
    sent: dict[str, tuple[int, float]] = field(default_factory=dict)  # worker -> (priority, when)
    # per router-holding strategy: idle sessions' priorities over it
    claims: dict[str, Counter[int]] = field(default_factory=dict)


class SessionHints:
    """The Retain ranking (see the module docstring)."""

    def __init__(self, cfg: HintPolicy, clock: Callable[[], float]):
        self.cfg = cfg
        self._clock = clock
        self._engines: dict[str, EngineView] = {}
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._first: OrderedDict[bytes, str] = OrderedDict()  # block -> first session
        self._shared: dict[bytes, _Shared] = {}
        # ended head block -> (end of its watch, the engine it is on)
        self._heads: dict[bytes, tuple[float, str]] = {}
        self._heads_watched = 100  # prior: 1 reuse in 100 blocks
        self._heads_reused = 1
        self.gaps = GapModel(prior_median_s=cfg.prior_gap_s)
        self.shared_gaps = [GapModel(300.0, 1.5, 5.0, 5.0) for _ in SHARED_CLASSES]
        self._next_tick = clock() + cfg.tick_s
        self.outcomes: Counter[str] = Counter()

    # ---- engines -------------------------------------------------------------

    def add_engine(self, name: str, g2_blocks: int, g1_blocks: int, hints_per_s: float) -> None:
        """An engine the ranking hints (from its ``hello``: G2 chunks x blocks
        per chunk, G1 blocks, and its per-client hint rate)."""
        self._engines[name] = EngineView(
            name, max(1, g2_blocks), max(0, g1_blocks), hints_per_s, self.cfg, self._clock()
        )

    def _priority(self, strategy: str, s: _Live, now: float) -> int:
        rank = strategy.split("+")[0]
        if rank == "plain":
            return 0
        idle = max(0.0, now - s.last_t)
        if rank == "density":
            return density_priority(self.gaps.density(idle))
        return density_priority(1.0 / (self.gaps.median() + idle))

    # ---- what the router sees ---------------------------------------------------

    def turn_started(
        self, session: str, worker: str, keys: Sequence[bytes], extra: Sequence[bytes] = ()
    ) -> list[Send]:
        """A turn of ``session`` goes to ``worker``; ``keys``: its prompt's
        full-block keys, root first (empty when the router cannot hash it);
        ``extra``: blocks the engine caches after them that no Retain covers
        (a partial last block it stores): they take room in the shadows."""
        now = self._clock()
        eng = self._engines.get(worker)
        s = self._live.get(session)
        if s is not None:
            if not s.active:
                self.gaps.add(now - s.last_t)
            self._live.move_to_end(session)
        else:
            s = self._live[session] = _Live(worker, [], 0, now)
            while len(self._live) > self.cfg.max_sessions:
                self._live.popitem(last=False)  # forgotten; the engine's idle timeout ends it
        self._clear_claims(s)  # a session in a turn claims nothing
        old = s.keys
        if old and (len(keys) < len(old) or keys[len(old) - 1] != old[-1]):
            self._drop_branch(session, s)  # not an extension (chained keys)
        # its blocks grow this turn: the next Retain goes whatever its priority
        s.active, s.last_t, s.worker, s.sent = True, now, worker, -1
        s.workers.add(worker)
        head = self._see_shared(session, keys, worker, now, seen=s.head if s.keys else 0)
        if not s.keys:
            s.first = len(keys)
        s.keys, s.head = list(keys), head
        if eng is not None:
            eng.requests += 1
            eng.first_t = now if eng.first_t is None else eng.first_t
            if eng.shadows:
                hits = {}
                for n, sh in eng.shadows.items():
                    ks = sh.keys_of(keys)
                    hits[n] = sh.request(ks + sh.keys_of(extra), len(ks), turn=session)
                if eng.selector.record(len(keys), hits):
                    for other in self._live.values():
                        if other.worker == worker:
                            other.sent = -2  # re-send under the new strategy
        self._claim(keys[:head], now, force=True)
        return self._drain(now)

    def turn_ended(self, session: str) -> list[Send]:
        """The turn finished and the session goes on (a tool call, or a chat
        waiting for its user)."""
        now = self._clock()
        s = self._live.get(session)
        if s is None:
            return []
        s.active, s.last_t = False, now
        eng = self._engines.get(s.worker)
        for sh in eng.shadows.values() if eng is not None else ():
            sh.finish(session)
        self._retain_session(session, s, now)
        self._claim(s.keys[: s.head], now, force=True)
        return self._drain(now)

    def sessions_on(self, worker: str) -> list[str]:
        """The live sessions whose turns last went to ``worker`` (at most
        ``max_sessions``: the ranking's own bound)."""
        return [sid for sid, s in self._live.items() if s.worker == worker]

    def session_ended(self, session: str) -> list[Out]:
        """The session is done: ended wherever it went; its head watched."""
        now = self._clock()
        s = self._live.pop(session, None)
        if s is None:
            return []
        self._clear_claims(s)
        out: list[Out] = []
        for w in sorted(s.workers):
            eng = self._engines.get(w)
            if eng is not None:
                for tag in ("retain", "first", "drop"):
                    eng.pending.pop((session, tag), None)
            out.append(End(w, session))
        full = len(s.keys)
        head = s.keys[s.head : max(s.head, math.ceil(full * HEAD_FRACTION))]
        eng = self._engines.get(s.worker)
        if eng is not None:
            for sh in eng.shadows.values():
                sh.finish(session)
                sh.release(sh.keys_of(s.keys), session)
            if head:
                until = now + self.cfg.watch_s
                for k in head:
                    self._heads[k] = (until, eng.name)
                while len(self._heads) > self.cfg.max_blocks:
                    self._heads.pop(next(iter(self._heads)))
                self._heads_watched += len(head)
                p = density_priority(self._heads_reused / (self._heads_watched * self.cfg.watch_s))
                self._queue(eng, ("head", p), head, p)
                for name, sh in eng.shadows.items():
                    if router_holds(name):
                        sh.set(sh.keys_of(head), p, ROUTER_OWNER)
        return out + self._drain(now)

    def tick(self) -> list[Send]:
        """Re-rank idle sessions and shared prefixes; call every ``tick_s``
        (more often is harmless: it only acts once per ``tick_s``)."""
        now = self._clock()
        if now < self._next_tick:
            return self._drain(now)
        self._next_tick = now + self.cfg.tick_s
        for m in (self.gaps, *self.shared_gaps):
            m.refresh()
        lapsed: dict[str, list[bytes]] = {}
        for k, (until, w) in list(self._heads.items()):
            if until <= now:
                del self._heads[k]
                lapsed.setdefault(w, []).append(k)
        claimed: list[bytes] = []
        steps = {name: e.rerank_steps(now, self.cfg.tick_s) for name, e in self._engines.items()}
        for sid, s in self._live.items():
            if s.active:
                continue
            eng = self._engines.get(s.worker)
            if eng is None:
                continue
            step = steps[eng.name]
            for name, sh in eng.shadows.items():
                p = self._priority(name, s, now)
                if reranked(s.shadow.get(name, -1), p, step[name]):
                    s.shadow[name] = p
                    self._shadow_retain(sh, sid, s, p)
            if self._session_claims(s, eng, now, rerank=step):
                claimed.extend(s.keys[: s.head])
            if reranked(
                s.sent, self._priority(eng.selector.current, s, now), step[eng.selector.current]
            ):
                eng.reranked += 1
                self._retain_session(sid, s, now, shadows=False)
                claimed.extend(s.keys[: s.head])
        for k in [k for k, st in self._shared.items() if now - st.last_new > self.cfg.watch_s]:
            # no new session came through it for watch_s: given up on (a
            # "never" for its model); its Retain lapses to plain LRU
            st = self._shared.pop(k)
            self._shared_model(st.sessions).add_never()
            for w in st.workers:
                lapsed.setdefault(w, []).append(k)
        for w, keys in lapsed.items():  # the shadows' router Retains lapse too
            eng = self._engines.get(w)
            for name, sh in eng.shadows.items() if eng else ():
                if router_holds(name):
                    sh.release(sh.keys_of(keys), ROUTER_OWNER)
        self._claim([k for k in dict.fromkeys(claimed) if k in self._shared], now, force=True)
        self._claim(list(self._shared), now, force=False)
        return self._drain(now)

    def outcome(self, action: str, status: str) -> None:
        """Count what one of our hints became."""
        self.outcomes[f"{action.removeprefix('kv.')}:{status}"] += 1

    def status(self) -> dict[str, Any]:
        """Per engine: the strategy, the shadows' scores, hints sent per request
        and per second, queued hints; and the outcomes."""
        now = self._clock()
        engines = {}
        for name, e in self._engines.items():
            span = max(1e-9, now - e.first_t) if e.first_t is not None else None
            engines[name] = {
                "g2_blocks": e.g2_blocks,
                "g1_blocks": e.g1_blocks,
                "strategy": e.selector.current,
                "switches": e.selector.switches,
                "scores": {k: round(v, 1) for k, v in e.selector.scores.items()},
                "hints_sent": e.sent,
                "reranked": e.reranked,
                "requests": e.requests,
                "hints_per_request": e.sent / e.requests if e.requests else 0.0,
                "hints_per_s": e.sent / span if span else 0.0,
                "queued": len(e.pending),
            }
        return {
            "engines": engines,
            "live_sessions": len(self._live),
            "shared_blocks": len(self._shared),
            "outcomes": dict(sorted(self.outcomes.items())),
        }

    # ---- internals ---------------------------------------------------------------

    def _shared_model(self, n: int) -> GapModel:
        k = 0
        while k + 1 < len(SHARED_CLASSES) and n >= SHARED_CLASSES[k + 1]:
            k += 1
        return self.shared_gaps[k]

    def _see_shared(
        self, session: str, keys: Sequence[bytes], worker: str, now: float, seen: int
    ) -> int:
        """Register the prompt's blocks; how many leading ones are shared (more
        than one session sent them: a chained key names its whole prefix, so
        they are a leading run). ``seen``: how many of them this session
        already came through."""
        m = 0
        first = self._first
        for j, k in enumerate(keys):
            st = self._shared.get(k)
            if st is None:
                owner = first.get(k)
                if owner is None or owner == session:
                    break
                st = self._shared[k] = _Shared(1, now, set())
                if len(self._shared) > self.cfg.max_blocks:  # the oldest found goes
                    self._shared.pop(next(iter(self._shared)))
                if self._heads.pop(k, (0.0, ""))[0] > now:
                    self._heads_reused += 1
            if j >= seen:  # a new session through it
                if st.sessions > 1:
                    self._shared_model(st.sessions).add(now - st.last_new)
                st.sessions += 1
                st.last_new = now
            st.workers.add(worker)
            m += 1
        for k in keys[m:]:
            if k in first:
                first.move_to_end(k)
            else:
                first[k] = session
        while len(first) > self.cfg.max_blocks:
            first.popitem(last=False)
        return m

    def _retain_session(self, sid: str, s: _Live, now: float, shadows: bool = True) -> None:
        eng = self._engines.get(s.worker)
        if eng is None:
            return
        grown = HEAD_BOOST and 0 < s.first < len(s.keys)
        if shadows:
            for name, sh in eng.shadows.items():
                p = s.shadow[name] = self._priority(name, s, now)
                self._shadow_retain(sh, sid, s, p)
        p = self._priority(eng.selector.current, s, now)
        self._session_claims(s, eng, now)
        if p == s.sent:
            return
        s.sent = p
        if p == 0 and not s.held:
            return  # nothing of it is held: nothing to send
        s.held = p > 0
        for tag in ("retain", "first"):
            eng.pending.pop((sid, tag), None)
        eng.pending[(sid, "retain")] = QueuedRetain(sid, p, boundary=s.keys[-1] if s.keys else None)
        if grown and p:
            eng.pending[(sid, "first")] = QueuedRetain(
                sid, p + HEAD_BOOST, boundary=s.keys[s.first - 1]
            )

    def _drop_branch(self, sid: str, s: _Live) -> None:
        """The session went back to an earlier turn or edited one (a retry, a
        branch): the Retains of the chain it left go, or that chain would
        stay held until the session ends (by its old priority, never
        re-ranked). A Retain at 0 up to the old chain's end releases it; the
        turn's end Retains the new chain."""
        eng = self._engines.get(s.worker)
        if eng is None:
            return
        for sh in eng.shadows.values():
            sh.release(sh.keys_of(s.keys), sid)
        for tag in ("retain", "first"):
            eng.pending.pop((sid, tag), None)
        if s.held:
            s.held = False
            eng.pending.pop((sid, "drop"), None)
            eng.pending[(sid, "drop")] = QueuedRetain(sid, 0, boundary=s.keys[-1])

    @staticmethod
    def _shadow_retain(sh: ShadowCache, sid: str, s: _Live, p: int) -> None:
        """What the session's Retains at ``p`` do, in one shadow."""
        sh.set(sh.keys_of(s.keys), p, sid)
        if p and 0 < s.first < len(s.keys):
            sh.set(sh.keys_of(s.keys[: s.first]), p + HEAD_BOOST, sid)

    def _session_claims(
        self, s: _Live, eng: EngineView, now: float, rerank: dict[str, int] | None = None
    ) -> bool:
        """Record, per router-holding strategy, what idle session ``s`` claims
        its shared head at: its rank there, with the first-turn boost (its
        shared head lies in its first-turn prefix: the router's re-claim
        never ranks a head below what follows it); whether any changed.
        ``rerank``: a tick's steps per strategy (``EngineView.rerank_steps``);
        else every change counts."""
        grown = HEAD_BOOST and 0 < s.first < len(s.keys)
        changed = False
        for name in eng.holders:
            p = self._priority(name, s, now)
            p = p + HEAD_BOOST if grown and p else p
            if reranked(s.claimed.get(name, 0), p, rerank.get(name, 1) if rerank else 1):
                changed |= self._set_claim(s, name, p)
        return changed

    def _clear_claims(self, s: _Live) -> None:
        for name in list(s.claimed):
            self._set_claim(s, name, 0)

    def _set_claim(self, s: _Live, name: str, p: int) -> bool:
        """Record that idle session ``s`` claims its shared head at ``p``
        under strategy ``name``; whether that changed."""
        old = s.claimed.get(name, 0)
        if p == old:
            return False
        for k in s.keys[: s.head]:
            st = self._shared.get(k)
            if st is None:
                continue
            claims = st.claims.setdefault(name, Counter())
            if old:
                claims[old] -= 1
                if claims[old] <= 0:
                    del claims[old]
            if p:
                claims[p] += 1
        if p:
            s.claimed[name] = p
        else:
            s.claimed.pop(name, None)
        return True

    def _claim(self, keys: Sequence[bytes], now: float, force: bool) -> None:
        """Router-owned Retains of shared ``keys`` on every engine that saw
        them, each at the highest priority claiming it under the engine's
        strategy; unchanged ones only when ``force`` or half their watch
        passed. Every router-holding shadow gets the same under its own
        strategy's claims."""
        if not keys:
            return
        groups: dict[tuple[str, int], list[bytes]] = {}
        shadow: dict[tuple[str, str, int], list[bytes]] = {}
        for k in keys:
            st = self._shared.get(k)
            if st is None:
                continue
            own = density_priority(self._shared_model(st.sessions).density(now - st.last_new))
            for w in st.workers:
                eng = self._engines.get(w)
                if eng is None:
                    continue
                for name in eng.holders:
                    p = max(own, max(st.claims.get(name, ()), default=0))
                    if name in eng.shadows:
                        shadow.setdefault((w, name, p), []).append(k)
                    if name != eng.selector.current:
                        continue
                    last = st.sent.get(w)
                    if (
                        not force
                        and last is not None
                        and p == last[0]
                        and now - last[1] < self.cfg.watch_s / 2
                    ):
                        continue
                    st.sent[w] = (p, now)
                    groups.setdefault((w, p), []).append(k)
        for (w, p), ks in groups.items():
            self._queue(self._engines[w], ("shared", p), ks, p)
        for (w, name, p), ks in shadow.items():
            sh = self._engines[w].shadows[name]
            sh.set(sh.keys_of(ks), p, ROUTER_OWNER)

    def _queue(self, eng: EngineView, tag: Any, keys: Sequence[bytes], p: int) -> None:
        """Queue a router-owned Retain of ``keys``, merged with the one of the
        same group still waiting, and moved behind everything queued (when
        the engine's strategy has the router hold them)."""
        if not router_holds(eng.selector.current):
            return
        old = eng.pending.pop((ROUTER_OWNER, tag), None)
        # a router entry always has keys; `or ()` would hide a None that raises today
        merged = list(dict.fromkeys([*(old.keys if old else ()), *keys]))  # type: ignore[misc]
        eng.pending[(ROUTER_OWNER, tag)] = QueuedRetain(
            ROUTER_OWNER, p, keys=merged, ttl_s=self.cfg.watch_s
        )

    def _drain(self, now: float) -> list[Send]:
        """What may leave now, per engine, in queue order: one envelope per
        run of hints for the same session."""
        out: list[Send] = []
        for eng in self._engines.values():
            while eng.pending and eng.take(now):
                _, r = eng.pending.popitem(last=False)
                if (
                    out
                    and isinstance(out[-1], Send)
                    and out[-1].worker == eng.name
                    and out[-1].session == r.session
                ):
                    out[-1].actions.append(r.action())
                else:
                    out.append(Send(eng.name, r.session, [r.action()]))
                eng.sent += 1
        return out
