"""The scheduler-side manager: vLLM's offloading manager (its tiering manager
with G3 tiers, the G2 primary tier alone without: ``connectors/g2.py``)
with the lock, the SessionPrefixIndex and the hints around it.

``SessionTierManager`` owns the index (one owner of mutable state) and wraps
vLLM's manager (``vllm``); G2 reports every change of residency to the index
(``connectors/g2.py``).

Wiring (ARCHITECTURE.md, "One composition root"): ``SessionTierSpec.get_manager``
builds the index, the quarantine, the event log and the G3 copy queue first and
hands them to the tiers and the manager as constructor arguments; the manager
builds the hint parts (``Mover``, ``Fetcher``, ``HintExecutor``) the same way.
Nothing is set on a part after it was built.

Threading (ARCHITECTURE.md, "Threads"): ``SessionTierManager.lock`` is the one lock,
a plain ``threading.Lock``: never taken twice by one thread (vLLM 0.33's
tiering manager lock is one too). vLLM 0.32 calls managers on the scheduler
thread, where ``SessionTierConnector`` holds the lock from its first
scheduler-side call of a ``schedule()`` pass until ``build_connector_meta``
returns, and around its other scheduler-side calls; so a chunk found by
``lookup`` cannot vanish before ``prepare_load``. The manager's methods expect
their caller to hold the lock, except the out-of-band ones (``status``,
``control_hints``, ``end_session``, ``resolve_hashes`` and the fetcher's
callbacks), which other threads call and which take it themselves. Those
threads only change metadata (pins, priorities, TTLs, session ends): never
evict, allocate or call ``lookup``.

Events (``sessionkv.events``) are appended to the event log when the engine
has one (the policy names a secret, so the control channel runs): residency
and eviction from the primary tier, transfers and outcomes from the manager.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Iterator
from typing import NamedTuple

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sessionkv.config import SessionKVConfig
from sessionkv.events import (
    Association,
    EventLog,
    Eviction,
    Op,
    Outcome,
    Transfer,
    Via,
    Wake,
)
from sessionkv.hints import Action, HintOutcome, KvHint, SessionTarget, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g3 import G3Tier
from sessionkv.types import Tier

from . import compat
from .fetch import Fetcher
from .g2 import SessionPrimaryTier
from .hint_executor import HintExecutor, Turn
from .metrics import SessionStats
from .moves import Mover

logger = init_logger(__name__)
# The status op holds the lock at most this long per batch of sessions, then
# sleeps long enough for a thread woken on another core to take it (Python's
# locks are not fair: a thread that lets go and takes again keeps it).
STATUS_HOLD_S = 0.002
STATUS_YIELD_S = 0.0002
# Slots of the index's alias map built per hold of the lock: about 2 ms
# (0.45 s a million here).
ALIAS_BUILD_SLOTS = 4096
# Tier names as events and stats carry them, read once: an enum member's
# ``name`` is a property call (two per G1 -> G2 store, 16 stores a decode step).
_G1, _G2 = Tier.G1.name, Tier.G2.name


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


class VllmTiering(compat.CascadeGate, compat.ParkedCascades, TieringOffloadingManager):
    """vLLM's tiering manager over G2 and the G3 tiers, cascading G2 -> G3
    only with ``g3.write_through``."""

    def __init__(self, primary_tier: SessionPrimaryTier,
                 secondary_tiers: list[SecondaryTierManager], write_through: bool,
                 **vllm_kwargs):
        super().__init__(primary_tier=primary_tier, secondary_tiers=secondary_tiers,
                         **vllm_kwargs)
        self._write_through = write_through

    def cascades(self) -> bool:
        # g3.write_through false: vLLM's cascade sends nothing down; hints do.
        return self._write_through


class SessionTierManager(OffloadingManager):
    """The offloading manager vLLM's connector calls: vLLM's own (``vllm``)
    with the lock, the SessionPrefixIndex and the HintExecutor around it, and
    each request's hints executed when it finishes.

    ``vllm`` is vLLM's tiering manager when there are G3 tiers, and the G2
    primary tier alone when there are none, as vLLM's own CPU spec runs it:
    the tiering layer's per-call work there is bookkeeping for cascades that
    cannot happen (about 330 Python lines of a 256-request decode step, 0.10
    ms p50 at 64k-token contexts in bench/scale.py; bench/README).

    Lock rule: the scheduler thread holds ``lock`` for each ``schedule()``
    pass (first scheduler-side connector call until ``build_connector_meta``
    returns) and around its other calls; any other thread takes ``lock`` and
    only changes metadata through ``executor``."""

    def __init__(
        self,
        primary_tier: SessionPrimaryTier,
        secondary_tiers: list[SecondaryTierManager],
        index: SessionPrefixIndex,
        config: SessionKVConfig,
        g3_copies: G3Copies,
        event_log: EventLog | None,
        **vllm_kwargs,
    ):
        """``g3_copies``: the queue every G3 tier observes into; ``event_log``:
        the primary tier's too (None: no event stream); ``vllm_kwargs``: what
        the running vLLM's tiering manager takes besides (``compat.manager_kwargs``)."""
        self.primary_tier = primary_tier
        self.secondary_tiers = secondary_tiers
        self.vllm: OffloadingManager = (
            VllmTiering(primary_tier, secondary_tiers, config.policy.g3.write_through,
                        **vllm_kwargs) if secondary_tiers else primary_tier)
        self._lock = compat.manager_lock(self.vllm)
        self.index = index
        self.config = config
        self.event_log = event_log
        self._g3_copies = g3_copies
        self.stats = SessionStats(primary_tier.get_kv_memoryview().strides[0],
                                  primary_tier.blocks_per_chunk)
        # G1 <-> G2 chunks copied since the last ``get_stats``, (src, dst) ->
        # chunks, counted under the lock rather than under the stats' own
        # (a decode step stores a block of every 16th request).
        self._copied: dict[tuple[str, str], int] = {}
        g3 = [t for t in secondary_tiers if isinstance(t, G3Tier)]
        # Demote/Prefetch/Share copy to and from the first G3 tier.
        wave = int(config.policy.limits.move_fraction * primary_tier.num_chunks)
        # Set when hint work waits for the lock's next hold (the control thread takes it).
        self.wake = Wake()
        self.mover = Mover(primary_tier, g3[0], self.emit, wave, self.wake) if g3 else None
        secret = config.policy.trust.secret
        # kv.fetch asks the source engine's control channel, with our secret.
        self.fetcher = (Fetcher(secret, self._fetched, self._emit_final)
                        if self.mover is not None and secret is not None else None)
        self.executor = HintExecutor(
            index, config.policy.limits, primary_tier.policy, primary_tier.num_chunks,
            primary_tier.blocks_per_chunk, mover=self.mover, fetcher=self.fetcher,
            emit=lambda o, via, s: self.emit(Outcome(outcome=o, via=via, session_id=s)),
            g3_cascades=config.policy.g3.write_through, wake=self.wake.set)
        self._finished_req: str | None = None    # the last on_request_finished's

    @property
    def lock(self) -> threading.Lock:
        """The one lock (module docstring): vLLM's tiering manager's on 0.33,
        ours otherwise."""
        return self._lock

    def emit(self, event) -> None:
        """Count ``event`` in the metrics; append it to the event log, if any."""
        self.stats.record(event)
        if self.event_log is not None:
            self.event_log.append(event)

    def emit_outcomes(self, outcomes, via: Via, session: str | None,
                      client: str | None = None) -> None:
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
                        sessions.append({
                            "session_id": s.session_id, "blocks": s.blocks,
                            "per_tier": {t.name: n for t, n in s.per_tier.items()},
                            "branches": len(s.frontiers), "last_access": s.last_access})
                    if time.perf_counter() - t0 >= STATUS_HOLD_S:
                        break
                pins += self.executor.pins(live)
                if i == len(names):
                    out = {"sessions": sessions, "pins": sorted(
                               pins, key=lambda p: (p["session_id"], p["hint_id"])),
                           "pinned_chunks": self.executor.pinned_chunks,
                           "outcomes": self.stats.outcome_totals(), "evictions": []}
                longest = max(longest, time.perf_counter() - t0)
            if i == len(names):
                break
            time.sleep(STATUS_YIELD_S)
        out["lock_max_ms"] = round(longest * 1e3, 3)
        if self.event_log is not None:
            _, _, next_seq = self.event_log.since(0, 0)
            recent, _, _ = self.event_log.since(max(0, next_seq - 1 - 10_000), 10_000)
            out["evictions"] = [{"seq": e.seq, "tier": e.tier, "chunks": len(e.keys),
                                 "reason": e.reason}
                                for e in recent if isinstance(e, Eviction)][-evictions:]
        return out

    def control_hints(self, items: list[KvHint | HintOutcome], session: str | None,
                      client: str) -> list[HintOutcome]:
        """Execute hints from the control channel now, under the lock."""
        with self.lock:
            if self.mover is not None:
                self.mover.begin_hold()
            outcomes = self.executor.execute_all(items, session, client=client)
            self.emit_outcomes(outcomes, Via.CONTROL, session, client)
            return outcomes

    def end_session(self, session: str, reason: str = "hint", now: float = 0.0) -> bool:
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
        with self.lock:
            self.mover.begin_hold()
            first = self.mover.start(Action.PREFETCH, hint.hint_id, keys, asked, None,
                                     name=hint.action.action_type)
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
        logger.info("sessionkv: drained %d live sessions to G3%s", len(sessions),
                    " (copies still running at the deadline)" if busy else "")
        return len(sessions)

    def shutdown(self) -> None:
        self.drain()
        self.vllm.shutdown()
        if self.fetcher is not None:
            self.fetcher.close()
        self.wake.close()
        if self.event_log is not None:
            self.event_log.close()

    # ---- scheduler side (the caller holds the lock) ---------------------------

    def get_stats(self):
        """vLLM's offloading stats, with sessionkv's (``connectors.metrics``)."""
        copied, self._copied = self._copied, {}
        return self.stats.take(len(self.index), self.index.num_sessions,
                               self.executor.pinned_chunks,
                               {t.tier_type: t.rejected for t in self.secondary_tiers
                                if isinstance(t, G3Tier)}, into=self.vllm.get_stats(),
                               copied=copied)

    def reset_cache(self) -> None:
        # vLLM's reset waits for its own jobs (drain_jobs); hint copies are
        # abandoned instead: their G2 slots stay in the quarantine until each
        # copy ends (G3Tier.move), so a reset never waits for a large Share.
        # The caller holds the lock (the connector's reset_cache).
        # vLLM 0.33 then holds promotions until on_reset_flushed (a worker may
        # still write a slot freed here for a job in flight); hint loads wait
        # for it too. 0.32 has no such fence (connectors/moves.py, "Reset").
        self.apply_moves()
        self.executor.drop_waiting("G2 was reset")
        if self.mover is not None:
            self.mover.abandon()
        self.vllm.reset_cache()
        if self.mover is not None and compat.VLLM_FENCES_RESETS:
            self.mover.fence()

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
            work += 1 + self.executor.release(ended[0])   # a session counts as a chunk
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
        self._index_g3_copies()
        if self.mover is not None:
            self.mover.apply()
        self.executor.step()

    def _index_g3_copies(self) -> None:
        """Index the G3 copies the tiers reported (``G3Copies``); a turn's
        chunks a Pin waits for in G3 arrive here (``HintExecutor.g3_stored``)."""
        for copy in self._g3_copies.drain():
            src, dst = (Tier.G3, Tier.G2) if copy.load else (Tier.G2, Tier.G3)
            self.stats.moved(src.name, dst.name, sum(copy.ok))
            found = [k for k, o in zip(copy.keys, copy.ok) if o]
            self.primary_tier.set_copies(Tier.G3, found, 1)
            if copy.load:     # a load that failed: the object is not there for us
                self.primary_tier.set_copies(
                    Tier.G3, [k for k, o in zip(copy.keys, copy.ok) if not o], 0)
            elif self.executor.waiting:     # a turn's chunks a Pin waits for in G3
                self.executor.g3_stored(copy.keys, copy.ok)

    # vLLM's manager interface: ``vllm`` does the work; G1 <-> G2 copies that
    # end are counted here too.

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self.vllm.lookup(key, req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return self.vllm.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        return self.vllm.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.vllm.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.vllm.complete_load(keys, req_context)
        self._transferred(_G2, _G1, keys, True, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        out = self.vllm.prepare_store(keys, req_context)
        if out is not None and out.evicted_keys and self.executor.waiting:
            self._index_g3_copies()     # copies that ended before vLLM freed their chunks
            self.executor.evicted(out.evicted_keys)
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self.vllm.complete_store(keys, req_context, success)
        self._transferred(_G1, _G2, keys, success, req_context)
        if self.executor.waiting:           # a turn's last chunks hints wait for
            self.executor.stored(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.vllm.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # vLLM prepared the request's last stores (or it had none).
        self.vllm.on_request_finished(req_context)
        self._finished_req = req_context.req_id
        if self.executor.waiting:
            self.executor.request_done(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.vllm.take_events()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.vllm.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.vllm.has_pending_work()

    def on_reset_flushed(self) -> None:        # vLLM 0.33
        self.vllm.on_reset_flushed()
        if self.mover is not None:
            self.mover.lift_fence()             # held loads start in the next apply

    def config_info(self):                      # vLLM 0.33
        return self.vllm.config_info()

    def _transferred(self, src: str, dst: str, keys: Collection[OffloadKey], ok: bool,
                     req_context: ReqContext) -> None:
        """A G1<->G2 copy ended (tier names): counted, and logged when there is
        a log. Without one no event is built (a decode step stores a block of
        every 16th request)."""
        if self.event_log is not None:
            self.emit(Transfer(src=src, dst=dst, keys=list(keys), ok=ok,
                               req_id=req_context.req_id))
        elif ok:
            pair = (src, dst)
            self._copied[pair] = self._copied.get(pair, 0) + len(keys)

    def execute_request_hints(self, hints: tuple[KvHint | HintOutcome, ...],
                              session: str | None, turn: Turn | None = None
                              ) -> tuple[HintOutcome, ...]:
        """Execute a finished request's hints (parsed when it arrived, the
        outcomes of unparsable ones included): one outcome each. ``turn``: its
        chunks, whose last ones the hints wait for (``connectors/hint_executor.py``)."""
        if not hints:
            return ()
        if turn is not None:
            self._index_g3_copies()     # the G3 copies that ended, before the turn is read
        try:
            outcomes = tuple(self.executor.execute_all(list(hints), session, turn=turn))
        except Exception:           # an executor bug must cost the hints, never the engine
            logger.exception("sessionkv: hints of a request of session %r failed", session)
            outcomes = tuple(i if isinstance(i, HintOutcome) else HintOutcome(
                i.hint_id, i.action.action_type, Status.REJECTED, reason="internal error")
                for i in hints)
        self.emit_outcomes(outcomes, Via.REQUEST, session)
        if turn is not None and turn.req_id == self._finished_req:
            self.executor.request_done(turn.req_id)     # vLLM had nothing more to store
        return outcomes
