"""Hint-driven copies between G2 and G3: Demote, Prefetch, Share.

These run outside vLLM's job table, so they work on an idle engine
(docs/design/architecture.md, "State and threads"), in waves of three phases:

1. ``start`` (under the tier manager's lock): reserve through the primary tier
   (``prepare_read`` pins the G2 chunks a store copies from; ``prepare_write``
   allocates not-yet-ready G2 slots a load copies into), then hand the copy to
   the G3 tier (``G3Tier.move``). The hint's outcome is ``deferred``.
2. The copy runs on the tier's I/O threads, which only queue the result and
   set the manager's ``Wake`` (they never take the lock).
3. ``apply`` (under the lock; the control channel's thread when woken, and the
   scheduler at the start of every pass): ``complete_read`` / ``complete_write``
   per chunk, so prefetched chunks become loadable only once their bytes are
   all in G2 (a request looking them up meanwhile sees ``HIT_PENDING`` and
   waits); then the next wave, or, after the last, one transfer event (every
   chunk moved) and the final outcome.

Waves: all hint copies together reserve at most ``wave_chunks`` G2 chunks at
a time (``limits.move_fraction`` of G2), so vLLM's own stores and promotions
still find chunks to evict or fill while a large Share or Prefetch runs. A
copy that finds the budget spent waits between its waves.

Slices: one hold of the lock looks up and reserves at most ``SLICE_CHUNKS``
chunks for hint copies, whatever the copies' size (``apply`` opens a hold's
slice, ``begin_hold`` another hold's that starts hints out of band). A copy that
finds the slice spent waits, paused, and the Mover wakes its own reader
(``Wake``) so the next hold goes on: a 16,384-chunk Prefetch or Share
reserved 25 % of G2 in one ``prepare_write`` under the step lock, 92 ms.
A Pin's G3 side runs in waves too (``G3Tier.pin`` per slice).

Actions:

- **Demote**: copy the target's G2 chunks to G3 (objects already there are
  kept), then make those G2 copies the first to go (``SessionCachePolicy.demote``).
- **Share**: the same copy without the eviction bias: the objects are published
  for other engines, which fetch them with a Prefetch naming the keys.
- **Prefetch**: copy the target's chunks that are not in G2 from G3 into G2;
  a no-op (``accepted``) when everything is resident. At most ``max_moves``
  copies run at once; further ones wait (``deferred``) and start in ``apply``.

Final outcomes: ``accepted`` (every chunk moved), ``clipped`` (some did),
``missing`` (a Prefetch found none in G3), ``rejected`` (the backend failed,
or a reset abandoned the copy).

Reset (``abandon``): a reset of G2 does not wait for hint copies. They are
given their final outcome at once and forgotten; their G2 slots stay in the
quarantine until the copy ends (``G3Tier.move`` holds them there), so no new
KV is written to a slot a late copy still reads or writes.

Reset fence (``fence``/``lift_fence``): a reset also frees G2 slots that a
worker may still write for a G1 -> G2 job in flight at the reset (a late
DMA). vLLM 0.33 holds its own promotions until ``on_reset_flushed`` says the
workers finished those jobs; the manager fences the Mover over the same
window, so no load wave (Prefetch, a Share's Prefetch, ``kv.fetch``)
reserves G2 meanwhile: a load move that reaches a wave waits, held, and
starts in the first ``apply`` after the fence lifts. Stores (Demote, Share,
a Pin's G3 side) read only chunks stored after the reset and run. vLLM 0.32
has no fence: its promotions are not held either; on the CPU platform the
worker's copies end before their job is reported (``TorchCopyWorker``), so
no late write exists there; on CUDA 0.32 a late DMA may land in a slot
filled after the reset, by vLLM's promotions and hint loads alike.

Threading: every method but the completion callback runs under the tier
manager's lock.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from sessionkv.events import Outcome, Transfer, Via, Wake
from sessionkv.hints import Action, HintOutcome, Status
from sessionkv.tiers.compat import LookupResult, OffloadKey, ReqContext
from sessionkv.tiers.g3.tier import G3Tier
from sessionkv.types import Tier, TierName

logger = logging.getLogger(__name__)
MAX_MOVES = 4
# The most chunks one hold of the lock looks up and reserves for hint copies
# (prepare_write is about 8 us a chunk here: 256 chunks about 2 ms).
SLICE_CHUNKS = 256


@dataclass
class Move:
    """One hint's copy: its chunks (G2/G3 keys) and where it stands."""

    action: Action
    hint_id: str
    target: list[OffloadKey]  # every chunk the hint names
    asked: int
    session: str | None
    ctx: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)  # the wave in flight
    check: list[OffloadKey] = field(default_factory=list)  # its chunks believed in G3 (stores)
    taken: int = 0  # target[:taken] went into waves
    ok: list[bool] | None = None  # set by the I/O thread when the wave ended
    good: list[OffloadKey] = field(default_factory=list)  # copied, by ended waves
    bad: int = 0  # not copied
    no_room: int = 0  # a load's chunks G2 had no slot for
    present: int = 0  # chunks that needed no copy
    clipped: str = ""  # the executor's clipping, if any
    ttl_s: float = 0.0  # a Pin's
    g2_blocks: int = 0  # a Pin's blocks pinned in G2 already
    lost: int = 0  # a Pin's G3 chunks it cannot reach
    reserved: bool = False  # prepare_read done: complete_read at the end
    abandoned: bool = False  # a reset gave the outcome: ignore the end
    label: str = ""  # the outcomes' action name, when not the action's
    already: list[OffloadKey] = field(default_factory=list)  # at the destination already

    @property
    def name(self) -> str:
        return self.label or self.action.action_type

    @property
    def is_load(self) -> bool:
        return self.action is Action.PREFETCH


class Mover:
    """Demote, Prefetch and Share copies (see the module docstring)."""

    def __init__(
        self,
        primary,
        tier: G3Tier,
        emit: Callable[[object], None],
        wave_chunks: int,
        wake: Wake,
        max_moves: int = MAX_MOVES,
    ):
        """``wave_chunks``: the most G2 chunks all copies reserve at a time (at
        least 1); ``wake``: set when copies ended or a slice was spent."""
        self._primary = primary  # SessionPrimaryTier (G2)
        self._tier = tier
        self._wake = wake.set
        self._emit = emit
        self._max = max_moves
        self._budget = max(1, wave_chunks)
        self._reserved = 0  # G2 chunks the waves in flight hold
        self._ids = itertools.count(1)
        self._running: list[Move] = []  # started, not final: a wave in flight or paused
        self._paused: deque[Move] = deque()  # between waves: the budget was spent
        self._waiting: deque[Move] = deque()  # not started: max_moves run
        self._finished: deque[Move] = deque()  # appended by I/O threads
        self._fenced = False  # a reset's flush is pending: loads wait
        self._slice = SLICE_CHUNKS  # chunks this hold of the lock may still take
        self._held: deque[Move] = deque()  # load moves waiting for the fence

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting or self._finished)

    # ---- under the lock ------------------------------------------------------------

    def in_g3(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The chunks among ``keys`` that the index knows in G3."""
        index = self._primary.index
        return [k for k in keys if (index.copies(k) or {}).get(Tier.G3, 0) > 0]

    def start(
        self,
        action: Action,
        hint_id: str,
        keys: list[OffloadKey],
        asked: int,
        session: str | None,
        clipped: str = "",
        ttl_s: float = 0.0,
        g2_blocks: int = 0,
        name: str = "",
    ) -> HintOutcome:
        """Begin one hint's copy of ``keys`` (chunk keys), or for a Pin the
        G3 side of it (``keys`` in G3; ``g2_blocks`` pinned in G2 already);
        its first outcome. ``clipped``: why the executor already cut the
        target (the final outcome is then ``clipped`` at best). ``name``: the
        outcomes' action name (default ``kv.<action>``; a kv.fetch's Prefetch
        answers as the fetch)."""
        move = Move(
            action,
            hint_id,
            list(keys),
            asked,
            session,
            ReqContext(req_id=f"sessionkv-{action.value}-{next(self._ids)}"),
            clipped=clipped,
            ttl_s=ttl_s,
            g2_blocks=g2_blocks,
            label=name,
        )
        if len(self._running) >= self._max:
            self._waiting.append(move)
            return self._outcome(move, Status.DEFERRED, "waiting for transfer capacity")
        return self._begin(move)

    def _begin(self, move: Move) -> HintOutcome:
        self._running.append(move)
        final = self._next_wave(move)
        if final is not None:
            return final
        n = len(move.target)
        if move.action is Action.PIN:
            return self._outcome(move, Status.DEFERRED, f"pinning {n} chunks in G3", move.g2_blocks)
        waves = f" in waves of at most {self._budget}" if n > self._budget else ""
        return self._outcome(
            move,
            Status.DEFERRED,
            f"copying {n} chunks {'from' if move.is_load else 'to'} G3{waves}",
        )

    def _next_wave(self, move: Move) -> HintOutcome | None:
        """Start the move's next wave that has something to copy; None when
        one runs or the move waits for the budget, else its final outcome
        (the move is then no longer running)."""
        while move.taken < len(move.target):
            if move.is_load and self._fenced:
                self._held.append(move)
                return None
            room = min(self._budget - self._reserved, self._slice)
            if room <= 0:
                self._paused.append(move)
                if self._slice <= 0:
                    self._wake()  # the next hold goes on (module docstring)
                return None
            wave = move.target[move.taken : move.taken + room]
            move.taken += len(wave)
            self._slice -= len(wave)
            if self._start_wave(move, wave):
                return None
        self._running.remove(move)
        return self._final(move)

    def _start_wave(self, move: Move, wave: list[OffloadKey]) -> bool:
        """Reserve ``wave``'s chunks that need a copy and start it; whether
        it started (False: nothing in it to copy)."""
        if move.action is Action.PIN:
            return self._start_pin_wave(move, wave)
        resident = [self._primary.lookup(k, move.ctx) for k in wave]
        if move.is_load:
            want = [k for k, r in zip(wave, resident) if r is LookupResult.MISS]
            move.already += [k for k, r in zip(wave, resident) if r is not LookupResult.MISS]
            move.present += len(wave) - len(want)
            if not want:
                return False
            out = self._primary.prepare_write(want, move.ctx)
            if out is None or not out.keys_to_store:
                move.no_room += len(want)
                return False
            move.keys, move.reserved = list(out.keys_to_store), False
            chunk_ids = out.store_spec.chunk_ids
        else:
            # Not in G2 but indexed in G3: asked again in the wave's job, so
            # "already in G3" never names an object the backend evicted.
            index = self._primary.index
            move.check = [
                k
                for k, r in zip(wave, resident)
                if r is not LookupResult.HIT and (index.copies(k) or {}).get(Tier.G3, 0) > 0
            ]
            move.keys = [k for k, r in zip(wave, resident) if r is LookupResult.HIT]
            if not move.keys and not move.check:
                return False
            chunk_ids = (
                self._primary.prepare_read(move.keys, move.ctx).chunk_ids if move.keys else []
            )
            move.reserved = bool(move.keys)
        self._reserved += len(move.keys)
        move.ok = None
        self._tier.move(
            move.is_load,
            move.keys,
            chunk_ids,
            partial(self._copied, move),
            check=move.check,
        )
        return True

    def _start_pin_wave(self, move: Move, wave: list[OffloadKey]) -> bool:
        """A Pin's G3 side for ``wave``: pinned from its G2 bytes when the
        tier rewrites objects to pin them (only chunks in G2 can be)."""
        chunk_ids = None
        move.keys = wave
        if self._tier.pin_needs_bytes:
            move.keys = [k for k in wave if self._primary.lookup(k, move.ctx) is LookupResult.HIT]
            move.lost += len(wave) - len(move.keys)
            if not move.keys:
                return False
            chunk_ids = self._primary.prepare_read(move.keys, move.ctx).chunk_ids
        move.reserved = chunk_ids is not None
        self._reserved += len(move.keys)
        move.ok = None
        self._tier.pin(move.keys, move.ttl_s, chunk_ids, partial(self._copied, move))
        return True

    def apply(self) -> None:
        """Finish the waves that ended; start the next ones, and waiting copies.
        No system call: the scheduler calls this every pass, and a loop of
        short GIL releases starves the threads that wait to take it back (an
        idle engine stepping while a request waits for its G3 load kept the
        disk tier's reads from their GIL for 5-10 s a load, past the 10 s
        deadline on CI); only a spent slice sets the ``Wake``. Opens this
        hold's slice."""
        self.begin_hold()
        while self._finished:
            move = self._finished.popleft()
            if move.abandoned:
                continue
            self._guarded(move, self._end_wave)
        while self._held and not self._fenced and self._slice > 0:
            self._guarded(self._held.popleft(), self._next_wave)
        while self._paused and self._reserved < self._budget and self._slice > 0:
            self._guarded(self._paused.popleft(), self._next_wave)
        while self._waiting and len(self._running) < self._max:
            self._guarded(self._waiting.popleft(), self._begin)

    def _guarded(self, move: Move, step: Callable[[Move], HintOutcome | None]) -> None:
        """``step(move)``; a final outcome it returns is emitted. A bug costs
        this hint, never the engine or the thread."""
        try:
            final = step(move)
        except Exception:
            logger.exception("sessionkv: %s %s failed", move.name, move.hint_id)
            if move in self._running:
                self._running.remove(move)
            final = self._outcome(move, Status.REJECTED, "internal error")
        if final is not None and final.status is not Status.DEFERRED:
            self._emit(Outcome(outcome=final, via=Via.TRANSFER, session_id=move.session))

    def _end_wave(self, move: Move) -> HintOutcome | None:
        ok = move.ok or [False] * (len(move.keys) + len(move.check))
        if move.check:
            ok, listed = ok[: len(move.keys)], ok[len(move.keys) :]
            there = [k for k, o in zip(move.check, listed) if o]
            move.present += len(there)
            move.already += there
            # Learned: the backend evicted these (the index keeps no copy it cannot show).
            self._primary.set_copies(Tier.G3, [k for k, o in zip(move.check, listed) if not o], 0)
            move.check = []
        good = [k for k, o in zip(move.keys, ok) if o]
        bad = [k for k, o in zip(move.keys, ok) if not o]
        self._reserved -= len(move.keys)
        if move.reserved:
            self._primary.complete_read(move.keys, move.ctx)
        if move.is_load:
            if good:
                self._primary.complete_write(good, move.ctx, True)
            if bad:
                self._primary.complete_write(bad, move.ctx, False)
        else:
            demote = getattr(self._primary.policy, "demote", None)
            if move.action is Action.DEMOTE and good and demote is not None:
                demote(good, move.session)
        move.good += good
        move.bad += len(bad)
        move.keys = []
        if self._paused:  # the budget goes round: waiting copies first
            self._paused.append(move)
            return None
        return self._next_wave(move)

    def _final(self, move: Move) -> HintOutcome:
        """The outcome of a copy whose waves all ended, after its one
        transfer event (none when it moved nothing, but for a store that
        found everything in G3: a Share's receiver needs the keys); a Pin's
        from ``_pin_outcome``, with no transfer event."""
        if move.action is Action.PIN:
            return self._pin_outcome(move)
        good, bad = len(move.good), move.bad + move.no_room
        done = self._blocks(good + move.present)
        if good or move.bad or (move.present and not move.is_load):
            src, dst = (Tier.G3, Tier.G2) if move.is_load else (Tier.G2, Tier.G3)
            self._emit(
                Transfer(
                    src=cast(TierName, src.name),
                    dst=cast(TierName, dst.name),
                    keys=move.good,
                    ok=not move.bad,
                    req_id=move.ctx.req_id,
                    hint_id=move.hint_id,
                    already=move.already,
                )
            )
        if not good and not move.bad:  # nothing was copied
            if not move.is_load:
                if move.present:
                    return self._outcome(move, Status.ACCEPTED, "already in G3", done)
                return self._outcome(move, Status.MISSING, "none of the target is in G2")
            if not move.no_room:
                return self._outcome(move, Status.ACCEPTED, "already in G2", done)
            if not move.present:
                return self._outcome(move, Status.REJECTED, "no room in G2")
            return self._outcome(
                move, Status.CLIPPED, f"{move.no_room} chunks found no room in G2", done
            )
        if not bad:
            return self._outcome(move, Status.ACCEPTED, "", done)
        if good:
            return self._outcome(
                move, Status.CLIPPED, f"{bad} of {good + bad} chunks not copied", done
            )
        if move.is_load:
            return self._outcome(move, Status.MISSING, "not readable from G3", done)
        return self._outcome(move, Status.REJECTED, "G3 store failed", done)

    def begin_hold(self) -> None:
        """A new hold of the lock: its slice of ``SLICE_CHUNKS`` opens."""
        self._slice = SLICE_CHUNKS

    def fence(self) -> None:
        """A reset freed G2 slots a worker may still write: hold load waves
        until ``lift_fence`` (vLLM 0.33's ``on_reset_flushed``)."""
        self._fenced = True

    def lift_fence(self) -> None:
        """The workers finished every job the reset flushed: held loads start
        in the next ``apply``."""
        self._fenced = False

    def abandon(self) -> None:
        """G2 is being reset: every copy gets its final outcome now and is
        forgotten (see the module docstring). The caller ``apply``s first,
        so that copies that ended are finished normally."""
        for move in [*self._running, *self._waiting]:
            move.abandoned = True
            done = self._blocks(len(move.good) + move.present)
            status = Status.CLIPPED if done else Status.REJECTED
            self._emit(
                Outcome(
                    outcome=self._outcome(move, status, "G2 was reset", done),
                    via=Via.TRANSFER,
                    session_id=move.session,
                )
            )
        self._running.clear()
        self._paused.clear()
        self._held.clear()
        self._waiting.clear()
        self._reserved = 0

    def _pin_outcome(self, move: Move) -> HintOutcome:
        """A Pin's outcome once its G3 side is known (every wave ended)."""
        tried = len(move.good) + move.bad
        missed = move.bad + move.lost
        affected = max(move.g2_blocks, self._blocks(len(move.good)))
        if not missed:
            return self._outcome(move, Status.ACCEPTED, "", affected)
        why = f"{missed} of {tried + move.lost} chunks not pinned in G3"
        if move.lost:
            why += f" ({move.lost} only in G3: pinning there rewrites them from G2)"
        if affected:
            return self._outcome(move, Status.CLIPPED, why, affected)
        return self._outcome(move, Status.REJECTED if tried else Status.MISSING, why)

    def _blocks(self, chunks: int) -> int:
        return chunks * self._primary.blocks_per_chunk

    def _outcome(self, move: Move, status: Status, reason: str, affected: int = 0) -> HintOutcome:
        if move.clipped and status in (Status.ACCEPTED, Status.CLIPPED, Status.DEFERRED):
            if status is Status.ACCEPTED:
                status = Status.CLIPPED
            reason = "; ".join(r for r in (move.clipped, reason) if r)
        return HintOutcome(move.hint_id, move.name, status, move.asked, affected, reason)

    # ---- I/O threads --------------------------------------------------------------

    def _copied(self, move: Move, ok: list[bool]) -> None:
        move.ok = ok
        self._finished.append(move)
        self._wake()
