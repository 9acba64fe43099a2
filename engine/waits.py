"""What request hints wait for: a finished turn's chunks still on their way
to G2 and G3, and the Pins and Retains acted on a slice per hold.

Request-borne hints act when their request finishes, on the whole turn
(``Turn``): vLLM stores a request's last chunks on a later step (it builds
their store jobs on the step after the request finished, and with async
scheduling, vLLM's default on GPUs, the block a turn's last tokens fill is
hashed only then), and G3's write-through copy of each chunk follows its G2
store. So the turn's trailing chunks that are not in G2 yet (vLLM stores in
order) are *waiting*, and for a Pin's G3 side with write-through so are its
chunks not in G3 yet whose G2 copy is still being written or read (G3 copies
end in any order): the hint acts on them when they arrive. Outcomes stay
truthful:

- Pin and Retain act at once on what G2 holds, and on each waiting chunk when
  its store ends; the response counts the waiting chunks in
  ``blocks_affected`` (``accepted``). Waiting chunks that never arrive, or that
  the pin quota refuses on arrival, come back later as one ``clipped``
  outcome (``Via.POLICY``, as pins clipped under pressure), naming how many.
- Demote and Share (and a Pin's G3 side) start their copy once every waiting
  chunk arrived or was dropped: the response says ``deferred`` and the copy's
  final outcome follows on the event stream, as for every copy; chunks that
  never arrived make it ``clipped``.

A waiting chunk is dropped (and counted lost) when its store fails, when vLLM
prepared the request's last stores without it (``request_done``), when its G2
copy is gone before reaching G3, at a reset (``drop_waiting``), and
``WAIT_S`` after its request finished. At most ``MAX_WAITING_CHUNKS`` chunks
(counting the targets waiting copies keep) and ``MAX_WAITS`` hint parts wait
at once; what does not fit acts as before (on what is resident) and the
outcome says so.
Control-channel hints (authenticated by the channel, so treated as signed)
act at once on what is resident.

``WaitingHints`` is ``HintExecutor``'s base (engine/executor.py): the
waiting state and its methods; the executor's acting methods (``_pin``,
``_pin_g3``) finish what arrived. ``PinBook``, ``Turn``, ``Rest`` and
``Wait`` are its records.

Threading: callers hold the session service's lock; it only changes metadata.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessionkv.events import Via
from sessionkv.hints import Action, HintOutcome, KvHint, Status
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.types import Tier

logger = logging.getLogger(__name__)

# Chunks of finished turns that hints wait for (module docstring), all hints
# together, and the hint parts waiting; a turn's tail is a few chunks (its
# stores and G3 copies in flight), so these bind only a runaway.
MAX_WAITING_CHUNKS = 16_384  # with the chunks a waiting copy keeps to start with
MAX_WAITS = 4096
# How long a waiting chunk may take to reach G2 and G3 after its request
# finished: vLLM stores it within a few steps, and every G3 store has its own
# deadline (tiers/g3/io.Guard); the bound only ends a wait nothing will end.
WAIT_S = 30.0
# The most G2 chunks a Pin or Retain acts on in one hold of the lock; the
# rest follow a slice a hold (``HintExecutor.step``, module docstring).
G2_SLICE_CHUNKS = 256


class PinBook:
    """The executor's pins: chunk -> (owner, hint id, signed), with each
    owner's chunks and each pool's count (signed, unsigned) kept as they change."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[str, str, bool]] = {}
        self._by_owner: dict[str, set[bytes]] = {}
        self._pooled = {True: 0, False: 0}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, k: bytes) -> bool:
        return k in self.entries

    def of(self, owner: str) -> frozenset[bytes]:
        return frozenset(self._by_owner.get(owner, ()))

    def pooled(self, signed: bool) -> int:
        return self._pooled[signed]

    def add(self, k: bytes, owner: str, hint_id: str, signed: bool) -> None:
        self.pop(k)
        self.entries[k] = (owner, hint_id, signed)
        self._by_owner.setdefault(owner, set()).add(k)
        self._pooled[signed] += 1

    def pop(self, k: bytes) -> tuple[str, str, bool] | None:
        entry = self.entries.pop(k, None)
        if entry is not None:
            owner, _, signed = entry
            mine = self._by_owner[owner]
            mine.discard(k)
            if not mine:
                del self._by_owner[owner]
            self._pooled[signed] -= 1
        return entry

    def pop_owner(self, owner: str) -> list[bytes]:
        mine = list(self._by_owner.get(owner, ()))
        for k in mine:
            self.pop(k)
        return mine


class Turn:
    """A finished request's chunks (G2/G3 keys), root first, for the hints it
    carried (module docstring): those at its end not in G2 yet, and those not
    in G3 yet whose G2 copy is still being written or read, may still be on
    their way. ``tail`` and ``among`` answer each question once per turn."""

    __slots__ = ("req_id", "chunks", "_tails")

    def __init__(self, req_id: str, chunks: Sequence[bytes]):
        self.req_id = req_id
        self.chunks = chunks
        self._tails: dict[str, set[bytes]] = {}

    def tail(self, name: str, pending: Callable[[bytes], bool], most: int) -> set[bytes]:
        """The chunks after the last one of which ``pending`` is false (vLLM
        stores a request's chunks in order, so an earlier one missing was
        dropped, not delayed); at most ``most`` + 1 are looked at."""
        got = self._tails.get(name)
        if got is None:
            got = set()
            for k in reversed(self.chunks):
                if len(got) > most or not pending(k):
                    break
                got.add(k)
            self._tails[name] = got
        return got

    def among(self, name: str, pending: Callable[[bytes], bool], most: int) -> set[bytes]:
        """The chunks of which ``pending`` is true, wherever they are (G3
        copies end in any order); at most ``most`` + 1."""
        got = self._tails.get(name)
        if got is None:
            got = set()
            for k in self.chunks:
                if pending(k):
                    got.add(k)
                    if len(got) > most:
                        break
            self._tails[name] = got
        return got


@dataclass(eq=False)
class Rest:
    """A Pin's or Retain's G2 chunks past its first slice, acted on by ``step``."""

    hint: KvHint
    session: str | None  # the request's (outcome events)
    owner: str
    keys: list[bytes]
    ttl: float | None
    at: int = 0  # keys[:at] were acted on
    lost: int = 0
    why: str = ""


@dataclass(eq=False)
class Wait:
    """One request hint's part that waits for its turn's chunks to arrive in
    ``tier`` (G2: their stores; G3: their write-through copies). ``take``
    acts on chunks as they arrive (Pin, Retain), or ``then`` once none is
    left to wait for (a copy, a Pin's G3 side), with the chunks arrived."""

    hint: KvHint
    session: str | None  # the request's (outcome events)
    owner: str
    tier: Tier
    keys: set[bytes]  # not arrived yet
    deadline: float
    ttl: float | None = None
    then: Callable[[Wait], HintOutcome] | None = None
    arrived: list[bytes] = field(default_factory=list)
    lost: int = 0
    why: str = ""  # why the last lost chunk was lost
    hold: int = 0  # chunks ``then`` keeps (the bound counts them)
    done: bool = False


def _never(_key: bytes) -> bool:
    return False


class WaitingHints:
    """The waits of request hints (module docstring), as ``HintExecutor``'s
    base: the executor sets the attributes annotated here and gives
    ``_pin`` and ``_pin_g3``."""

    _index: SessionPrefixIndex
    _policy: SessionCachePolicy | None
    _bpc: int
    _clock: Callable[[], float]
    _chunk: Any  # G2's chunk status (vLLM's ChunkStatus), None without a policy
    _emit: Callable[[HintOutcome, Via, str | None], None]
    _wake: Callable[[], None]
    _cascades: bool

    def _pin(
        self, hint: KvHint, session_id: str | None, chunks: list[bytes], ttl: float, later: int = 0
    ) -> tuple[list[bytes], int, str]:
        raise NotImplementedError  # HintExecutor's

    def __init__(self) -> None:
        self._waits: dict[Tier, dict[bytes, list[Wait]]] = {Tier.G2: {}, Tier.G3: {}}
        self._waits_of: dict[str, list[Wait]] = {}  # request id -> its, until request_done
        self._order: deque[Wait] = deque()  # as registered: by deadline
        self._live = 0  # waits not settled
        self._n_waiting = 0  # chunks waited for
        self._n_held = 0  # chunks waits keep for their copy
        self._rest: deque[Rest] = deque()  # Pins and Retains past a slice

    @property
    def waiting(self) -> bool:
        """Whether any hint waits for a turn's chunks (``stored``,
        ``g3_stored``, ``evicted`` and ``request_done`` have work)."""
        return self._n_waiting > 0 or bool(self._waits_of)

    def stored(self, keys: Iterable[bytes], ok: bool) -> None:
        """vLLM's G2 stores of ``keys`` ended (``complete_store``)."""
        self._arrive(Tier.G2, keys, self._ready if ok else _never, "not stored in G2")
        if not ok:
            self._arrive(Tier.G3, keys, _never, "not stored in G2")

    def g3_stored(self, keys: Sequence[bytes], ok: Sequence[bool]) -> None:
        """G3 copies of ``keys`` ended (the tiers' write-through stores)."""
        if self._waits[Tier.G3]:
            done = dict(zip(keys, ok))
            self._arrive(Tier.G3, keys, done.__getitem__, "not copied to G3")

    def evicted(self, keys: Iterable[bytes]) -> None:
        """G2 evicted ``keys``: none of them reaches G3 any more."""
        if self._waits[Tier.G3]:
            self._arrive(Tier.G3, keys, _never, "evicted from G2 before reaching G3")

    def request_done(self, req_id: str) -> None:
        """vLLM prepared the last stores of request ``req_id``: its turn's
        chunks that G2 does not hold now never arrive; those it holds ready
        arrived."""
        for w in self._waits_of.pop(req_id, ()):
            if w.done:
                continue
            ready = []
            for k in list(w.keys):
                chunk = self._chunk(k)
                if chunk is None:
                    self._unwait(w, k)
                    w.lost, w.why = w.lost + 1, "not stored in G2"
                elif w.tier is Tier.G2 and chunk.is_ready:
                    self._unwait(w, k)
                    ready.append(k)
            if ready:
                self._take(w, ready)
            if not w.keys:
                self._settle(w)

    def step(self) -> None:
        """Go on with the Pins and Retains past their first slice: at most
        ``G2_SLICE_CHUNKS`` chunks (module docstring, "Slices"); ``wake``
        when some are left. Under the lock."""
        budget = G2_SLICE_CHUNKS
        while self._rest and budget > 0:
            r = self._rest[0]
            keys = r.keys[r.at : r.at + budget]
            r.at += len(keys)
            budget -= len(keys)
            self._act(r, keys)
            if r.at >= len(r.keys):
                self._rest.popleft()
                self._end_rest(r)
        if self._rest:
            self._wake()

    def _end_rest(self, r: Rest, why: str = "") -> None:
        """``r``'s chunks were all acted on (or ``why`` the rest were not): a
        ``clipped`` outcome for those lost."""
        if why and r.at < len(r.keys):
            r.lost, r.why, r.at = r.lost + len(r.keys) - r.at, why, len(r.keys)
        if r.lost:
            name = r.hint.action.action_type
            verb = "retained" if r.hint.action is Action.RETAIN else "pinned"
            self._emit(
                HintOutcome(
                    r.hint.hint_id,
                    name,
                    Status.CLIPPED,
                    0,
                    r.lost * self._bpc,
                    f"{r.lost} chunks not {verb}: {r.why}",
                ),
                Via.POLICY,
                r.session,
            )

    def drop_waiting(self, why: str) -> None:
        """G2 is being reset: every wait ends now (Pin and Retain report the
        chunks they did not hold; waiting copies are rejected, not started),
        and so do the Pins and Retains past their first slice."""
        while self._rest:
            self._end_rest(self._rest.popleft(), why)
        for w in self._order:
            if not w.done:
                self._settle(w, why, run=False)
        self._order.clear()
        self._waits_of.clear()

    def _absent(self, k: bytes) -> bool:
        return self._chunk(k) is None

    def _ready(self, k: bytes) -> bool:
        chunk = self._chunk(k)
        return chunk is not None and chunk.is_ready

    def _unready(self, k: bytes) -> bool:
        return not self._ready(k)

    def _not_in_g3(self, k: bytes) -> bool:
        return not (self._index.copies(k) or {}).get(Tier.G3, 0)

    def _later(
        self, turn: Turn | None, name: str, targets: list[bytes], pending: Callable[[bytes], bool]
    ) -> list[bytes]:
        """The ``targets`` at the end of ``turn`` that are still ``pending``."""
        if turn is None or self._chunk is None or not targets:
            return []
        tail = turn.tail(name, pending, MAX_WAITING_CHUNKS - self._n_waiting)
        return [k for k in targets if k in tail] if tail else []

    def _copying(self, k: bytes) -> bool:
        """Not in G3, and its G2 copy is being written or read: its
        write-through copy to G3 may be on its way."""
        if not self._not_in_g3(k):
            return False
        chunk = self._chunk(k)
        return chunk is not None and chunk.ref_cnt != 0

    def _g3_later(
        self, turn: Turn | None, targets: list[bytes], absent: list[bytes]
    ) -> list[bytes]:
        """The ``targets`` of ``turn`` whose write-through copy to G3 may still
        come: not stored in G2 yet (``absent``), or stored and being copied."""
        if turn is None or self._chunk is None or not targets:
            return []
        moving = turn.among("g3", self._copying, MAX_WAITING_CHUNKS - self._n_waiting)
        later = set(absent).union(moving) if absent else moving
        return [k for k in targets if k in later and self._not_in_g3(k)] if later else []

    def _fit(self, keys: list[bytes], hold: int = 0) -> list[bytes]:
        """The first of ``keys`` that can wait (``MAX_WAITING_CHUNKS``,
        ``MAX_WAITS``), none unless the ``hold`` chunks the wait keeps for
        its copy fit too."""
        room = MAX_WAITING_CHUNKS - self._n_waiting - self._n_held - hold
        if not keys or self._live >= MAX_WAITS or room <= 0:
            return []
        return keys[:room]

    def _wait(
        self,
        hint: KvHint,
        session: str | None,
        owner: str,
        tier: Tier,
        keys: list[bytes],
        turn: Turn,
        ttl: float | None = None,
        then: Callable[[Wait], HintOutcome] | None = None,
        hold: int = 0,
    ) -> None:
        w = Wait(
            hint, session, owner, tier, set(keys), self._clock() + WAIT_S, ttl, then, hold=hold
        )
        self._n_held += hold
        table = self._waits[tier]
        for k in w.keys:
            table.setdefault(k, []).append(w)
        self._n_waiting += len(w.keys)
        self._live += 1
        self._order.append(w)
        if len(self._order) > 2 * MAX_WAITS:  # settled ones in the middle
            self._order = deque(x for x in self._order if not x.done)
        self._waits_of.setdefault(turn.req_id, []).append(w)
        while len(self._waits_of) > MAX_WAITS:  # a request vLLM never reported done
            del self._waits_of[next(iter(self._waits_of))]

    def _unwait(self, w: Wait, k: bytes) -> None:
        """``w`` no longer waits for ``k``."""
        w.keys.discard(k)
        self._n_waiting -= 1
        table = self._waits[w.tier]
        ws = table.get(k)
        if ws is not None:
            ws.remove(w)
            if not ws:
                del table[k]

    def _arrive(
        self, tier: Tier, keys: Iterable[bytes], ok: Callable[[bytes], bool], why: str
    ) -> None:
        """``keys`` arrived in ``tier`` (or, where ``ok`` is false, never will)."""
        table = self._waits[tier]
        got: dict[Wait, list[bytes]] = {}
        for k in keys:
            ws = table.pop(k, None)
            if ws is None:
                continue
            good = ok(k)
            for w in ws:
                w.keys.discard(k)
                self._n_waiting -= 1
                mine = got.setdefault(w, [])
                if good:
                    mine.append(k)
                else:
                    w.lost, w.why = w.lost + 1, why
        for w, arrived in got.items():
            if arrived:
                self._take(w, arrived)
            if not w.keys:
                self._settle(w)

    def _take(self, w: Wait, keys: list[bytes]) -> None:
        """Chunks ``w`` waited for are there: pinned or retained now, or kept
        for its ``then``."""
        if w.then is not None:
            w.arrived += keys
            return
        self._act(w, keys)

    def _act(self, part: Wait | Rest, keys: list[bytes]) -> None:
        """Pin or retain ``keys`` for ``part`` (a wait's arrived chunks, a
        slice of a large hint's rest); those it cannot are counted in
        ``part.lost``, with why."""
        if part.owner and not self._index.has_session(part.owner):
            part.lost, part.why = part.lost + len(keys), "the session ended"
            return
        policy = self._policy
        assert policy is not None  # waits and rests are made only with the session policy
        present = [k for k in keys if policy.get(k) is not None]
        if len(present) < len(keys):
            part.lost, part.why = part.lost + len(keys) - len(present), "not in G2"
        if part.hint.action is Action.RETAIN:
            policy.retain(present, part.hint.bounds.priority, part.ttl, part.owner)
            return
        assert part.ttl is not None  # a Pin's parts carry its TTL
        done, _, _ = self._pin(part.hint, part.session, present, part.ttl)
        if len(done) < len(present):
            part.lost, part.why = part.lost + len(present) - len(done), "pin quota"

    def _settle(self, w: Wait, why: str = "", run: bool = True) -> None:
        """``w`` waits for nothing more (``why`` the rest is lost): its final
        outcome, or its copy started (``then``; not when ``run`` is false)."""
        w.done = True
        self._live -= 1
        self._n_held -= w.hold
        if w.keys:
            for k in list(w.keys):
                self._unwait(w, k)
                w.lost += 1
            w.why = why
        hint, name = w.hint, w.hint.action.action_type
        if w.then is None:
            if w.lost:
                self._emit(
                    HintOutcome(
                        hint.hint_id,
                        name,
                        Status.CLIPPED,
                        0,
                        w.lost * self._bpc,
                        f"{w.lost} of the turn's last chunks not "
                        f"{'retained' if hint.action is Action.RETAIN else 'pinned'}: {w.why}",
                    ),
                    Via.POLICY,
                    w.session,
                )
            return
        if not run:
            out = HintOutcome(
                hint.hint_id,
                name,
                Status.REJECTED,
                reason=f"{why} before the turn's last chunks were stored",
            )
        else:
            try:
                out = w.then(w)
            except Exception:  # a bug must cost this hint, never the engine
                logger.exception("sessionkv: %s %s failed", name, hint.hint_id)
                out = HintOutcome(hint.hint_id, name, Status.REJECTED, reason="internal error")
        if out.status is not Status.DEFERRED:
            self._emit(out, Via.TRANSFER, w.session)

    def _expire(self, now: float) -> None:
        """End the waits past their deadline (``WAIT_S``), the oldest first."""
        while self._order and (self._order[0].done or self._order[0].deadline <= now):
            w = self._order.popleft()
            if not w.done:
                self._settle(w, f"not there {WAIT_S:g} s after the request finished")
