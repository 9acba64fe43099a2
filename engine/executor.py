"""HintExecutor: trust, limits, resolution and one outcome for every hint.

Order for each hint: parse (``sessionkv.hints``) -> trust (a valid router
signature, or an unsigned Pin of the request's own session within the unsigned
quota) -> rate limit per client -> resolution against the SessionPrefixIndex
(``missing`` when nothing resident answers) -> bounds clipped to the limits ->
the action. Pin and Retain act on G2 through ``SessionCachePolicy`` (pin quotas
per session, global, and a separate unsigned pool, as fractions of G2). Demote,
Prefetch and Share are copies between G2 and G3 (``engine.mover.Mover``):
they answer ``deferred`` and get their final outcome when the copy ended (on
the event stream). A Prefetch naming exact keys fetches them from G3 even when
this engine never saw them (the receiving side of a Share). Pins the policy
later clips under pressure come back from ``collect_clipped`` as ``clipped``.

Request-borne hints act when their request finishes, on the whole turn;
what they wait for, and the bounds on it: ``engine/waits.py``. Requests
are read and rate-limited by ``engine/requests.py``.

Slices: a Pin or Retain acts on at most ``G2_SLICE_CHUNKS`` of its G2
chunks in the hold of the lock that executes it; the rest (``Rest``) are
pinned or retained a slice per later hold (``step``, from the manager's
``apply_moves``: each scheduler pass, and the control thread, woken by
``wake`` while work is left). The response counts them in
``blocks_affected``; those that left G2 meanwhile, that the pin quota
refuses then, or whose session ended, come back later as one ``clipped``
outcome (``Via.POLICY``), as waiting chunks do. A reset drops them
(``drop_waiting``). A 16,384-chunk Pin held the lock for its whole G2 side
(81 ms in the policy alone, bench/scale_holds.py).
``release(session)`` drops what an ended session pinned and retained.

Cost: the pin book (``waits.PinBook``) is indexed by owner and counted per pool, and
lapses come from the policy (``take_unpinned``): a hint costs its own chunks
and a session's end its own pins, never a pass over every live pin. Waiting
chunks cost a dict lookup per chunk stored while any waits (``waiting``); a
turn's tail is found from its end (``Turn.tail``), and a Pin's G3 side looks
at each of the turn's chunks once (``Turn.among``), as its G3 resolution does.

Threading: callers hold the tier manager's lock (the scheduler thread during
its pass, or any other thread); it only changes metadata.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from sessionkv.config import Limits
from sessionkv.engine.fetch import Fetcher
from sessionkv.engine.mover import Mover
from sessionkv.engine.requests import TokenBuckets
from sessionkv.engine.waits import G2_SLICE_CHUNKS, PinBook, Rest, Turn, Wait, WaitingHints
from sessionkv.events import Via
from sessionkv.hints import (
    Action,
    HashesTarget,
    HintOutcome,
    KeysTarget,
    KvHint,
    SessionTarget,
    Status,
)
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.types import Tier

logger = logging.getLogger(__name__)

MAX_CLIPPED_HINTS = 4096  # clipped outcomes waiting for collect_clipped (one per hint)
# A Retain up to a boundary the index no longer holds took the session's
# deepest branch: clipped, since what was evicted is not held.
BOUNDARY_GONE = "boundary evicted: the session's deepest branch"


class HintExecutor(WaitingHints):
    """Gives every hint one outcome (see the module docstring).

    ``mover``: the G2 <-> G3 copies (None without a G3 tier: Demote, Prefetch
    and Share are rejected); ``fetcher``: kv.fetch (None without a G3 tier
    and a control secret); ``emit(outcome, via, session)``: the outcomes of
    hints that waited for their turn's chunks (module docstring);
    ``g3_cascades``: G2 stores are copied on to G3 (``g3.write_through``), so
    a Pin's G3 side waits for its turn's last chunks to get there."""

    def __init__(
        self,
        index: SessionPrefixIndex,
        limits: Limits,
        policy: object = None,
        g2_chunks: int = 0,
        blocks_per_chunk: int = 1,
        clock: Callable[[], float] = time.monotonic,
        mover: Mover | None = None,
        fetcher: Fetcher | None = None,
        emit: Callable[[HintOutcome, Via, str | None], None] | None = None,
        g3_cascades: bool = False,
        wake: Callable[[], None] | None = None,
    ):
        super().__init__()
        self._index = index
        self._limits = limits
        self._policy = policy if isinstance(policy, SessionCachePolicy) else None
        self._bpc = blocks_per_chunk
        self._buckets = TokenBuckets(limits.hints_per_s_per_client, clock)
        cap = lambda f: int(math.floor(f * g2_chunks))  # noqa: E731
        self._cap_session = cap(limits.pin_fraction_session)
        self._cap_global = cap(limits.pin_fraction_global)
        self._cap_unsigned = cap(limits.unsigned_pin_fraction)
        self._pins = PinBook()
        self._clipped: dict[str, int] = {}  # hint id -> its chunks clipped, not yet told
        self._mover = mover
        self._fetcher = fetcher
        self._clock = clock
        # Waiting chunks (module docstring). G2's chunk status (any policy).
        self._chunk = getattr(policy, "get", None)
        self._emit = emit or (lambda outcome, via, session: None)
        self._cascades = g3_cascades and mover is not None
        self._wake = wake or (lambda: None)

    def execute_all(
        self,
        items: list[KvHint | HintOutcome],
        session_id: str | None,
        client: str | None = None,
        turn: Turn | None = None,
    ) -> list[HintOutcome]:
        return [
            i if isinstance(i, HintOutcome) else self.execute(i, session_id, client, turn)
            for i in items
        ]

    def execute(
        self,
        hint: KvHint,
        session_id: str | None,
        client: str | None = None,
        turn: Turn | None = None,
    ) -> HintOutcome:
        """One hint's outcome. ``session_id`` is the request's (or the control
        request's) session; ``client`` names the rate-limit bucket (default:
        the session); ``turn``: the finished request's chunks, for a request's
        hints (module docstring)."""
        name = hint.action.action_type

        def outcome(status: Status, reason: str, asked: int = 0, affected: int = 0):
            return HintOutcome(hint.hint_id, name, status, asked, affected, reason)

        if not hint.signed and not self._unsigned_ok(hint, session_id):
            return outcome(Status.REJECTED, "unsigned: request hints need the router's signature")
        if not self._buckets.take(client or session_id or "anonymous"):
            return outcome(Status.REJECTED, "rate limit exceeded")

        if isinstance(hint.target, HashesTarget):
            # KVCR's kv.fetch: only the source can map its 64-bit hashes to keys.
            asked = len(hint.target.block_hashes)
            limit = min(self._limits.max_blocks_per_hint, hint.bounds.max_blocks or asked)
            if self._fetcher is None:
                return outcome(
                    Status.REJECTED,
                    "kv.fetch needs a G3 tier and a control secret the source trusts",
                    asked,
                )
            if asked > limit:
                return outcome(Status.REJECTED, f"kv.fetch of more than {limit} blocks", asked)
            return self._fetcher.start(hint)
        if hint.action is Action.PREFETCH and isinstance(hint.target, KeysTarget):
            clipped: list[str] = []
            asked, keys, reason = len(hint.target.keys), list(hint.target.keys), ""
            in_g3 = None
        else:
            asked, keys, reason, clipped, in_g3 = self._resolve(hint)
        if not keys:
            return outcome(Status.MISSING, reason, asked)
        limit = min(self._limits.max_blocks_per_hint, hint.bounds.max_blocks or len(keys))
        if len(keys) > limit:
            clipped.append(f"blocks clipped to {limit}")
            keys = keys[:limit]  # the prefix first: what a turn reuses
        ttl = hint.bounds.ttl_s
        if ttl is not None and ttl > self._limits.max_ttl_s:
            clipped.append(f"ttl clipped to {self._limits.max_ttl_s:g} s")
            ttl = self._limits.max_ttl_s
        owner = self._owner(hint, session_id)
        if hint.action in (Action.DEMOTE, Action.PREFETCH, Action.SHARE):
            if self._mover is None:
                return outcome(Status.REJECTED, "Demote, Prefetch and Share need a G3 tier", asked)
            if not isinstance(hint.target, KeysTarget) or hint.action is not Action.PREFETCH:
                keys = self._index.chunk_keys(keys, self._bpc)
            if hint.action is not Action.PREFETCH:
                # The copy starts once the turn's last chunks are in G2.
                later = self._fit(self._later(turn, "unready", keys, self._unready), len(keys))
                if later:
                    self._wait(
                        hint,
                        session_id,
                        owner,
                        Tier.G2,
                        later,
                        turn,
                        hold=len(keys),
                        then=lambda w: self._mover.start(
                            hint.action, hint.hint_id, keys, asked, owner, self._reasons(clipped, w)
                        ),
                    )
                    return outcome(
                        Status.DEFERRED,
                        self._reasons(
                            clipped,
                            None,
                            (
                                f"copying {len(keys)} chunks to G3 once the turn's last "
                                f"{len(later)} are stored"
                            ),
                        ),
                        asked,
                    )
            return self._mover.start(
                hint.action, hint.hint_id, keys, asked, owner, "; ".join(clipped)
            )
        if hint.action not in (Action.PIN, Action.RETAIN):
            return outcome(Status.REJECTED, "not implemented", asked)
        if self._policy is None:
            return outcome(Status.REJECTED, "Pin and Retain need g2.eviction: session", asked)
        chunks = [k for k in keys if self._policy.get(k) is not None]
        chunks, rest = chunks[:G2_SLICE_CHUNKS], chunks[G2_SLICE_CHUNKS:]
        pin_g3 = hint.action is Action.PIN and self._mover is not None
        targets = self._index.chunk_keys(keys, self._bpc) if turn is not None or pin_g3 else []
        # The turn's chunks not in G2 yet: held when they arrive.
        later = self._later(turn, "absent", targets, self._absent)
        # A Pin also holds the target's objects in G3 (the backend's own
        # pins), those of the turn once its write-through copies are there.
        g3 = (
            (
                [k for k in targets if k in in_g3]
                if in_g3 is not None
                else self._mover.in_g3(targets)
            )
            if pin_g3
            else []
        )
        g3_later = self._g3_later(turn, targets, later) if pin_g3 and self._cascades else []
        if not chunks and not g3 and not later and not g3_later:
            return outcome(Status.MISSING, "none of the target is in G2", asked)
        if hint.action is Action.PIN and ttl is None:
            ttl = self._limits.max_ttl_s
        if hint.action is Action.RETAIN:
            self._policy.retain(chunks, hint.bounds.priority, ttl, owner)
            done = chunks
        else:
            done, room, why = self._pin(hint, session_id, chunks, ttl, len(later))
            later = later[:room]
            if why:
                clipped.append(why)
        if rest:
            self._rest.append(Rest(hint, session_id, owner, rest, ttl))
            self._wake()
            done = done + rest
        held = self._fit(later)
        if len(held) < len(later):
            clipped.append(
                f"{len(later) - len(held)} of the turn's last chunks not held: "
                "too many chunks waiting"
            )
        if held:
            self._wait(hint, session_id, owner, Tier.G2, held, turn, ttl=ttl)
        affected = self._blocks_in(done + held, keys)
        g3_held = self._fit(g3_later, len(g3))
        if len(g3_held) < len(g3_later):
            clipped.append(
                f"{len(g3_later) - len(g3_held)} of the turn's last chunks not "
                "pinned in G3: too many chunks waiting"
            )
        if g3_held:
            self._wait(
                hint,
                session_id,
                owner,
                Tier.G3,
                g3_held,
                turn,
                ttl=ttl,
                hold=len(g3),
                then=lambda w: self._pin_g3(
                    hint, owner, g3 + w.arrived, asked, clipped, ttl, affected, w
                ),
            )
            return outcome(
                Status.DEFERRED,
                self._reasons(
                    clipped,
                    None,
                    (
                        f"pinning {len(g3) + len(g3_held)} chunks in G3, the turn's last "
                        f"{len(g3_held)} once they are there"
                    ),
                ),
                asked,
                affected,
            )
        if g3:
            return self._mover.start(
                Action.PIN,
                hint.hint_id,
                g3,
                asked,
                owner,
                "; ".join(clipped),
                ttl_s=ttl,
                g2_blocks=affected,
            )
        status = Status.CLIPPED if clipped else Status.ACCEPTED
        return outcome(status, "; ".join(clipped), asked, affected)

    def _blocks_in(self, chunks: list[bytes], keys: list[bytes]) -> int:
        """How many of ``keys`` (blocks) the G2 ``chunks`` (keyed by their last block) hold."""
        if self._bpc == 1:
            return len(chunks)
        wanted = set(keys)
        return sum(len(wanted.intersection(self._index.chain_to(c, self._bpc))) for c in chunks)

    def _pin(
        self, hint: KvHint, session_id: str | None, chunks: list[bytes], ttl: float, later: int = 0
    ) -> tuple[list[bytes], int, str]:
        """Pin within the quotas: (chunks pinned, how many of ``later`` chunks
        still to arrive the quotas leave room for, clip reason or "")."""
        owner = self._owner(hint, session_id)
        self._forget_lapsed()
        mine = self._pins.of(owner)
        pool = self._pins.pooled(hint.signed)
        if hint.signed:
            room = min(self._cap_session - len(mine), self._cap_global - pool)
        else:
            room = self._cap_unsigned - pool
        new = [k for k in chunks if k not in self._pins]
        take = new[: max(room, 0)]
        fits = min(later, max(room - len(take), 0))
        again = [k for k in chunks if k in mine]  # re-pinning extends the TTL
        self._policy.pin(again + take, ttl)
        # Only what the policy pinned (a chunk gone from G2 meanwhile is not):
        # the book holds no pin the policy will never report ended.
        take = [k for k in take if self._policy.pin_expiry(k) is not None]
        for k in take:
            self._pins.add(k, owner, hint.hint_id, hint.signed)
        lost = len(new) - len(take) + later - fits
        return again + take, fits, (f"pin quota: {lost} chunks not pinned" if lost else "")

    @staticmethod
    def _owner(hint: KvHint, session_id: str | None) -> str:
        """The session a pin or retain belongs to (its quota, its release)."""
        t = hint.target
        return t.session_id if isinstance(t, SessionTarget) else (session_id or "")

    @property
    def pinned_chunks(self) -> int:
        """G2 chunks pinned by hints now."""
        return len(self._pins)

    def pins(self, owners: Iterable[str]) -> list[dict[str, Any]]:
        """The live pins of ``owners`` (sessions), one entry per (session,
        hint): chunks and seconds until the first and last of them lapse.
        Costs those owners' pins, not every pin."""
        if self._policy is None:
            return []
        self._forget_lapsed()
        now = self._policy.clock()
        groups: dict[tuple[str, str], list[float]] = {}
        for owner in owners:
            for k in self._pins.of(owner):
                expiry = self._policy.pin_expiry(k)
                if expiry is not None:
                    groups.setdefault((owner, self._pins.entries[k][1]), []).append(expiry - now)
        return [
            {
                "session_id": o,
                "hint_id": h,
                "chunks": len(left),
                "expires_in_s": [round(min(left), 3), round(max(left), 3)],
            }
            for (o, h), left in sorted(groups.items())
        ]

    def release(self, session: str) -> int:
        """Drop the pins and retains ``session`` holds (it ended); how many chunks."""
        if self._policy is None:
            return 0
        mine = self._pins.pop_owner(session)
        self._policy.unpin(mine)
        return len(mine) + self._policy.release_retains(session)

    def _forget_lapsed(self) -> None:
        """Bring the book up to date with the policy: pins that ended, and
        pins it clipped (their outcomes wait for ``collect_clipped``)."""
        for k in self._policy.take_unpinned():
            self._pins.pop(k)
        for k in self._policy.take_clipped():
            entry = self._pins.pop(k)
            if entry is not None:
                hint_id = entry[1]
                self._clipped[hint_id] = self._clipped.pop(hint_id, 0) + 1
                while len(self._clipped) > MAX_CLIPPED_HINTS:  # nobody collects them
                    del self._clipped[next(iter(self._clipped))]

    def collect_clipped(self) -> list[HintOutcome]:
        """Pins the policy clipped under G2 pressure since the last call, one
        ``clipped`` outcome per hint; the owner calls this every step, so the
        policy's sets stay small. Waits past their deadline end here too."""
        if self._order:
            self._expire(self._clock())
        if self._policy is None or not (self._pins or self._clipped):
            return []  # the policy reports only pins booked here (most steps: none)
        self._forget_lapsed()
        lost, self._clipped = self._clipped, {}
        return [
            HintOutcome(
                hint_id,
                Action.PIN.action_type,
                Status.CLIPPED,
                0,
                n,
                f"{n} pinned chunks evicted: G2 had nothing else left",
            )
            for hint_id, n in lost.items()
        ]

    def _pin_g3(
        self,
        hint: KvHint,
        owner: str,
        keys: list[bytes],
        asked: int,
        clipped: list[str],
        ttl: float,
        g2_blocks: int,
        w: Wait,
    ) -> HintOutcome:
        """A Pin's G3 side once the turn's last chunks reached G3 (or never will)."""
        why = self._reasons(clipped, w)
        if keys:
            return self._mover.start(
                Action.PIN, hint.hint_id, keys, asked, owner, why, ttl_s=ttl, g2_blocks=g2_blocks
            )
        return HintOutcome(
            hint.hint_id,
            hint.action.action_type,
            Status.CLIPPED if g2_blocks else Status.REJECTED,
            asked,
            g2_blocks,
            why,
        )

    @staticmethod
    def _reasons(clipped: list[str], w: Wait | None, *more: str) -> str:
        """The clip reasons, a wait's lost chunks and ``more``, joined."""
        lost = [f"{w.lost} of the turn's last chunks {w.why}"] if w is not None and w.lost else []
        return "; ".join([*clipped, *lost, *more])

    def _unsigned_ok(self, hint: KvHint, session_id: str | None) -> bool:
        """Unsigned Pins of the request's own session, when the operator
        enabled their separate quota."""
        t = hint.target
        return (
            hint.action is Action.PIN
            and self._limits.unsigned_pin_fraction > 0
            and not isinstance(t, (KeysTarget, HashesTarget))
            and session_id is not None
            and t.session_id == session_id
        )

    def _resolve(self, hint: KvHint) -> tuple[int, list[bytes], str, list[str], set[bytes] | None]:
        """(blocks the hint asks for, resident block keys root first, reason
        when none, what clipped the target, those of the keys in G3)."""
        t = hint.target
        if isinstance(t, KeysTarget):
            found = self._index.resolve_keys(list(t.keys))
            return (
                len(t.keys),
                found.keys,
                "none of the keys is resident",
                [],
                set(found.per_tier[Tier.G3]),
            )
        res = self._index.resolve_session(t.session_id, t.branch, t.boundary)
        if (
            res is None
            and hint.action is Action.RETAIN
            and t.boundary is not None
            and t.boundary not in self._index
        ):
            # The boundary's blocks were evicted (the index prunes them): what
            # is left of that chain is a resident prefix of it, and the
            # session's deepest branch is the best guess for it. A router's
            # re-rank of a partly evicted session would otherwise be "missing"
            # and its blocks keep their old priority until it ends (the replay,
            # coding trace, G2 1024: 1,173 of 6,376 router Retains were).
            # Only a Retain: it orders eviction, it moves no quota.
            deepest = self._index.deepest_branch(t.session_id)
            if deepest is not None:
                res = self._index.resolve_session(t.session_id, branch=deepest)
                if res is not None and res.keys:
                    return (
                        len(res.keys),
                        res.keys,
                        "",
                        [BOUNDARY_GONE],
                        set(res.per_tier[Tier.G3]),
                    )
        if res is None:
            if self._index.is_ended(t.session_id):
                return 0, [], "session ended", [], None
            if not self._index.has_session(t.session_id):
                return 0, [], "unknown session", [], None
            return 0, [], "branch or boundary is not part of the session", [], None
        return (
            len(res.keys),
            res.keys,
            "session has no resident blocks",
            [],
            set(res.per_tier[Tier.G3]),
        )
