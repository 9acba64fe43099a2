"""The session service: the engine's contract with everything that is not
vLLM's scheduler (the control channel, the connector's per-request hints,
the probe, the fetcher): status, control hints, session ends, hash
resolution, drain, expiry, hint copies.

It owns the hint parts (``HintExecutor``, ``Mover``, ``Fetcher``) and drives
the tiers it is given (G2 and the first G3 tier); the connector's
``OffloadingManager`` adapter (``connectors/manager.py``) calls it around
vLLM's manager calls. It imports no vLLM.

Threading (docs/design/architecture.md, "State and threads"): ``lock`` is the one lock,
a plain ``threading.Lock`` given by the adapter (vLLM 0.33's tiering manager
lock, or our own), never taken twice by one thread. The scheduler thread
holds it for each ``schedule()`` pass and calls the "scheduler side" methods
below under it. The out-of-band methods (``status``, ``control_hints``,
``end_session``, ``resolve_hashes``, ``drain`` and the fetcher's callbacks)
take it themselves; those threads only change metadata (pins, priorities,
TTLs, session ends): never evict, allocate or call ``lookup``.

Events (``sessionkv.events``) are counted by ``stats`` and appended to the
event log when the engine has one (the policy names a secret, so the control
channel runs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Literal, NamedTuple, Protocol

from sessionkv.config import SessionKVConfig
from sessionkv.engine.executor import HintExecutor
from sessionkv.engine.fetch import Fetcher
from sessionkv.engine.mover import Mover
from sessionkv.engine.waits import Turn
from sessionkv.events import Association, EventLog, Eviction, Op, Outcome, Via, Wake
from sessionkv.hints import Action, HintOutcome, KvHint, SessionTarget, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.compat import OffloadKey
from sessionkv.tiers.g2.tier import SessionPrimaryTier
from sessionkv.tiers.g3.tier import G3Tier
from sessionkv.types import Tier

logger = logging.getLogger(__name__)
# The status op holds the lock at most this long per batch of sessions, then
# sleeps long enough for a thread woken on another core to take it (Python's
# locks are not fair: a thread that lets go and takes again keeps it).
STATUS_HOLD_S = 0.002
STATUS_YIELD_S = 0.0002
# Slots of the index's alias map built per hold of the lock: about 2 ms
# (0.45 s a million here).
ALIAS_BUILD_SLOTS = 4096


class Recorder(Protocol):
    """What the service counts into (``connectors.metrics.SessionStats``)."""

    def record(self, event: object) -> None: ...
    def moved(self, src: str, dst: str, chunks: int) -> None: ...
    def outcome_totals(self) -> dict[str, int]: ...
    def control_work(self, op: str, seconds: float) -> None: ...


class G3Copy(NamedTuple):
    """A copy a G3 tier's I/O thread saw end: a load (G3 -> G2) or a store."""

    load: bool
    keys: list[OffloadKey]
    ok: list[bool]


class G3Copies:
    """The G3 copies the tiers' I/O threads saw end (every G3 tier's
    ``observer``), indexed later by the manager under its lock. Appending
    never blocks; the manager drains it at the start of every scheduler pass."""

    def __init__(self):
        self._seen: deque[G3Copy] = deque()

    def observe(self, load: bool, keys: list[OffloadKey], ok: list[bool]) -> None:
        self._seen.append(G3Copy(load, keys, ok))

    def drain(self) -> Iterator[G3Copy]:
        while self._seen:
            yield self._seen.popleft()


class SessionService:
    """The engine's session contract over G2, a G3 tier (None: no hint
    copies) and the index. Out-of-band methods take ``lock``; scheduler-side
    ones expect the caller to hold it (module docstring)."""

    def __init__(
        self,
        primary_tier: SessionPrimaryTier,
        g3: G3Tier | None,
        index: SessionPrefixIndex,
        config: SessionKVConfig,
        g3_copies: G3Copies,
        event_log: EventLog | None,
        stats: Recorder,
        lock: threading.Lock,
    ):
        """``g3_copies``: the queue every G3 tier observes into; ``event_log``:
        None for no event stream; ``lock``: the one lock (module docstring)."""
        self.primary_tier = primary_tier
        self.index = index
        self.config = config
        self.event_log = event_log
        self.stats = stats
        self.lock = lock
        self._g3_copies = g3_copies
        # Demote/Prefetch/Share copy to and from the first G3 tier.
        wave = int(config.policy.limits.move_fraction * primary_tier.num_chunks)
        # Set when hint work waits for the lock's next hold (the control thread takes it).
        self.wake = Wake()
        self.mover = Mover(primary_tier, g3, self.emit, wave, self.wake) if g3 else None
        secret = config.policy.trust.secret
        # kv.fetch asks the source engine's control channel, with our secret.
        self.fetcher = (
            Fetcher(secret, self._fetched, self._emit_final)
            if self.mover is not None and secret is not None
            else None
        )
        self.executor = HintExecutor(
            index,
            config.policy.limits,
            primary_tier.policy,
            primary_tier.num_chunks,
            primary_tier.blocks_per_chunk,
            mover=self.mover,
            fetcher=self.fetcher,
            emit=lambda o, via, s: self.emit(Outcome(outcome=o, via=via, session_id=s)),
            g3_cascades=config.policy.g3.write_through,
            wake=self.wake.set,
        )
        self._finished_req: str | None = None  # the last request_finished's

    def emit(self, event) -> None:
        """Count ``event`` in the metrics; append it to the event log, if any."""
        self.stats.record(event)
        if self.event_log is not None:
            self.event_log.append(event)

    def emit_outcomes(
        self, outcomes, via: Via, session: str | None, client: str | None = None
    ) -> None:
        for o in outcomes:
            self.emit(Outcome(outcome=o, via=via, session_id=session, client=client))

    # ---- out-of-band (any thread) ---------------------------------------

    def status(self, max_sessions: int = 1000, evictions: int = 20) -> dict:
        """What ``sessionkv status`` shows: sessions (most recent first) with
        blocks per tier, their pins and expiry (and the count of all pinned
        chunks), hint outcome counts since start, the latest evictions the
        event log holds, and ``lock_max_ms``, the longest the lock was held
        for it. Any thread: sessions are summarized in batches of at most
        ``STATUS_HOLD_S`` under the lock (plus one session), letting it go in
        between, so a scheduler pass waits that long at most; each session is
        consistent, the list a view over those few milliseconds."""
        with self.lock:
            names = self.index.recent_sessions(max_sessions)
        sessions: list[dict] = []
        pins: list[dict] = []
        longest, i = 0.0, 0
        while True:
            with self.lock:
                t0 = time.perf_counter()
                live = []
                while i < len(names):
                    s = self.index.summary(names[i])
                    i += 1
                    if s is not None:
                        live.append(s.session_id)
                        sessions.append(
                            {
                                "session_id": s.session_id,
                                "blocks": s.blocks,
                                "per_tier": {t.name: n for t, n in s.per_tier.items()},
                                "branches": len(s.frontiers),
                                "last_access": s.last_access,
                            }
                        )
                    if time.perf_counter() - t0 >= STATUS_HOLD_S:
                        break
                pins += self.executor.pins(live)
                if i == len(names):
                    out = {
                        "sessions": sessions,
                        "pins": sorted(pins, key=lambda p: (p["session_id"], p["hint_id"])),
                        "pinned_chunks": self.executor.pinned_chunks,
                        "outcomes": self.stats.outcome_totals(),
                        "evictions": [],
                    }
                longest = max(longest, time.perf_counter() - t0)
            if i == len(names):
                break
            time.sleep(STATUS_YIELD_S)
        out["lock_max_ms"] = round(longest * 1e3, 3)
        if self.event_log is not None:
            _, _, next_seq = self.event_log.since(0, 0)
            recent, _, _ = self.event_log.since(max(0, next_seq - 1 - 10_000), 10_000)
            out["evictions"] = [
                {"seq": e.seq, "tier": e.tier, "chunks": len(e.keys), "reason": e.reason}
                for e in recent
                if isinstance(e, Eviction)
            ][-evictions:]
        return out

    def control_hints(
        self, items: list[KvHint | HintOutcome], session: str | None, client: str
    ) -> list[HintOutcome]:
        """Execute hints from the control channel now, under the lock."""
        with self.lock:
            if self.mover is not None:
                self.mover.begin_hold()
            outcomes = self.executor.execute_all(items, session, client=client)
            self.emit_outcomes(outcomes, Via.CONTROL, session, client)
            return outcomes

    def end_session(
        self, session: str, reason: Literal["", "hint", "idle"] = "hint", now: float = 0.0
    ) -> bool:
        """End a session: the index forgets its branches, its pins and retains
        are released. Whether it was live."""
        with self.lock:
            live = self.index.end_session(session, now)
            self.executor.release(session)
            if live:
                self.emit(Association(session_id=session, op=Op.END, reason=reason))
            return live

    def resolve_hashes(self, block_hashes: list[int]) -> list[bytes]:
        """The chunk keys of the blocks named by 64-bit hashes that this engine
        holds, root first (the control channel's ``resolve``). The first call
        builds the index's alias map, ``ALIAS_BUILD_SLOTS`` at a time under
        the lock, letting it go between."""
        while True:
            with self.lock:
                if self.index.build_aliases(ALIAS_BUILD_SLOTS):
                    keys = self.index.resolve_aliases(block_hashes).keys
                    return self.index.chunk_keys(keys, self.primary_tier.blocks_per_chunk)
            time.sleep(STATUS_YIELD_S)

    def _fetched(self, hint: KvHint, keys: list[bytes], asked: int) -> None:
        """A kv.fetch's source published ``keys``: prefetch them here."""
        mover = self.mover
        assert mover is not None  # a fetcher exists only with a mover
        with self.lock:
            mover.begin_hold()
            first = mover.start(
                Action.PREFETCH, hint.hint_id, keys, asked, None, name=hint.action.action_type
            )
            if first.status is not Status.DEFERRED:
                self.emit(Outcome(outcome=first, via=Via.TRANSFER))

    def _emit_final(self, outcome: HintOutcome) -> None:
        with self.lock:
            self.emit(Outcome(outcome=outcome, via=Via.TRANSFER))

    def drain(self) -> int:
        """Demote every live session to G3 before the engine exits, so that its
        next turn on another engine loads instead of recomputing; waits up to
        ``sessions.drain_timeout_s`` for the copies (their chunks already in
        G3, as write-through leaves them, cost nothing). The sessions asked.
        Any thread; takes the lock."""
        timeout = self.config.policy.sessions.drain_timeout_s
        if self.mover is None or timeout <= 0:
            return 0
        with self.lock:
            sessions = self.index.sessions()
            for i, session in enumerate(sessions):
                hint = KvHint(f"drain-{i}", Action.DEMOTE, SessionTarget(session), signed=True)
                self.emit_outcomes([self.executor.execute(hint, session)], Via.POLICY, session)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                self.apply_moves()
                busy = self.mover.busy
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        logger.info(
            "sessionkv: drained %d live sessions to G3%s",
            len(sessions),
            " (copies still running at the deadline)" if busy else "",
        )
        return len(sessions)

    def close(self) -> None:
        """Stop the fetcher and the wake fd, close the event log (after
        ``drain`` and vLLM's shutdown)."""
        if self.fetcher is not None:
            self.fetcher.close()
        self.wake.close()
        if self.event_log is not None:
            self.event_log.close()

    # ---- scheduler side (the caller holds the lock) ---------------------------

    def expire_sessions(self, now: float, max_chunks: int | None = None) -> bool:
        """End the sessions idle past the policy's timeout, the oldest first,
        until their pins and retains released reach ``max_chunks`` (scheduler
        thread: a pass's cost stays bounded however many idle out at once);
        whether it stopped there, so that more may be waiting."""
        work = 0
        while max_chunks is None or work < max_chunks:
            ended = self.index.expire(now, 1)
            if not ended:
                return False
            work += 1 + self.executor.release(ended[0])  # a session counts as a chunk
            self.emit(Association(session_id=ended[0], op=Op.END, reason="idle"))
        return True

    def collect_clipped(self) -> None:
        """Emit the pins the G2 policy clipped since the last call, one
        ``clipped`` outcome per hint (scheduler thread, every pass)."""
        for late in self.executor.collect_clipped():
            self.emit(Outcome(outcome=late, via=Via.POLICY))

    def apply_moves(self) -> None:
        """Index the G3 copies the tiers reported, finish the hint copies that
        ended (``Mover.apply``) and go on with large Pins and Retains
        (``HintExecutor.step``), a slice of each per hold. The caller holds
        the lock: the scheduler at the start of each pass, the control
        channel when ``wake`` is set."""
        self.index_g3_copies()
        if self.mover is not None:
            self.mover.apply()
        self.executor.step()

    def index_g3_copies(self) -> None:
        """Index the G3 copies the tiers reported (``G3Copies``); a turn's
        chunks a Pin waits for in G3 arrive here (``HintExecutor.g3_stored``)."""
        for copy in self._g3_copies.drain():
            src, dst = (Tier.G3, Tier.G2) if copy.load else (Tier.G2, Tier.G3)
            self.stats.moved(src.name, dst.name, sum(copy.ok))
            found = [k for k, o in zip(copy.keys, copy.ok) if o]
            self.primary_tier.set_copies(Tier.G3, found, 1)
            if copy.load:  # a load that failed: the object is not there for us
                self.primary_tier.set_copies(
                    Tier.G3, [k for k, o in zip(copy.keys, copy.ok) if not o], 0
                )
            elif self.executor.waiting:  # a turn's chunks a Pin waits for in G3
                self.executor.g3_stored(copy.keys, copy.ok)

    def before_reset(self) -> None:
        """G2 is about to be reset: hint copies are abandoned instead of
        waited for; their G2 slots stay in the quarantine until each copy
        ends (G3Tier.move), so a reset never waits for a large Share."""
        self.apply_moves()
        self.executor.drop_waiting("G2 was reset")
        if self.mover is not None:
            self.mover.abandon()

    def after_reset(self, fenced: bool) -> None:
        """G2 was reset; ``fenced``: vLLM holds promotions until
        ``reset_flushed`` (0.33: a worker may still write a slot freed by the
        reset for a job in flight), and hint loads wait for it too."""
        if self.mover is not None and fenced:
            self.mover.fence()

    def reset_flushed(self) -> None:
        """vLLM 0.33's fence lifted: held loads start in the next apply."""
        if self.mover is not None:
            self.mover.lift_fence()

    def evicted(self, keys: list[OffloadKey]) -> None:
        """vLLM freed these G2 chunks for a store."""
        if self.executor.waiting:
            self.index_g3_copies()  # copies that ended before vLLM freed their chunks
            self.executor.evicted(keys)

    def stored(self, keys, success: bool) -> None:
        """A G1 -> G2 store ended."""
        if self.executor.waiting:  # a turn's last chunks hints wait for
            self.executor.stored(keys, success)

    def request_finished(self, req_id: str) -> None:
        """vLLM prepared the request's last stores (or it had none)."""
        self._finished_req = req_id
        if self.executor.waiting:
            self.executor.request_done(req_id)

    def execute_request_hints(
        self, hints: tuple[KvHint | HintOutcome, ...], session: str | None, turn: Turn | None = None
    ) -> tuple[HintOutcome, ...]:
        """Execute a finished request's hints (parsed when it arrived, the
        outcomes of unparsable ones included): one outcome each. ``turn``: its
        chunks, whose last ones the hints wait for (``engine/executor.py``)."""
        if not hints:
            return ()
        if turn is not None:
            self.index_g3_copies()  # the G3 copies that ended, before the turn is read
        try:
            outcomes = tuple(self.executor.execute_all(list(hints), session, turn=turn))
        except Exception:  # an executor bug must cost the hints, never the engine
            logger.exception("sessionkv: hints of a request of session %r failed", session)
            outcomes = tuple(
                i
                if isinstance(i, HintOutcome)
                else HintOutcome(
                    i.hint_id, i.action.action_type, Status.REJECTED, reason="internal error"
                )
                for i in hints
            )
        self.emit_outcomes(outcomes, Via.REQUEST, session)
        if turn is not None and turn.req_id == self._finished_req:
            self.executor.request_done(turn.req_id)  # vLLM had nothing more to store
        return outcomes
