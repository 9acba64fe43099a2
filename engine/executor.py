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

Slices: a Pin or Retain acts on at most ``G2_SLICE_CHUNKS`` of its G2
chunks in the hold of the lock that executes it; the rest (``_Rest``) are
pinned or retained a slice per later hold (``step``, from the manager's
``apply_moves``: each scheduler pass, and the control thread, woken by
``wake`` while work is left). The response counts them in
``blocks_affected``; those that left G2 meanwhile, that the pin quota
refuses then, or whose session ended, come back later as one ``clipped``
outcome (``Via.POLICY``), as waiting chunks do. A reset drops them
(``drop_waiting``). A 16,384-chunk Pin held the lock for its whole G2 side
(81 ms in the policy alone, bench/scale_holds.py).
``release(session)`` drops what an ended session pinned and retained.

Cost: the pin book (``PinBook``) is indexed by owner and counted per pool, and
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
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from sessionkv.config import Limits
from sessionkv.engine.fetch import Fetcher
from sessionkv.engine.mover import Mover
from sessionkv.events import Via
from sessionkv.hints import (
    HINTS_PARAM,
    KVCR_PARAM,
    MAX_ACTIONS,
    MAX_KEYS,
    SIG_PARAM,
    Action,
    HashesTarget,
    HintOutcome,
    KeysTarget,
    KvHint,
    SessionTarget,
    Status,
    id_problem,
    parse_envelope,
    parse_kvcr_fetch,
    signature_problem,
    verify,
)
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.types import Tier

logger = logging.getLogger(__name__)

KVCR_SIG_PARAM = "kv_hint_sig"
MAX_CLIPPED_HINTS = 4096  # clipped outcomes waiting for collect_clipped (one per hint)
MAX_ENVELOPE_KEYS = MAX_KEYS  # keys in all of a request envelope's targets
TOO_BIG = f"an envelope has at most {MAX_ACTIONS} actions naming {MAX_ENVELOPE_KEYS} keys in all"
# A Retain up to a boundary the index no longer holds took the session's
# deepest branch: clipped, since what was evicted is not held.
BOUNDARY_GONE = "boundary evicted: the session's deepest branch"
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


class TokenBuckets:
    """Per-client token buckets: ``rate`` hints per second, bursts of ``rate``.
    Bounded: idle clients are forgotten beyond ``max_clients``."""

    def __init__(self, rate: float, clock: Callable[[], float], max_clients: int = 4096):
        self._rate = rate
        self._clock = clock
        self._max = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, client: str) -> bool:
        now = self._clock()
        tokens, last = self._buckets.pop(client, (self._rate, now))
        tokens = min(self._rate, tokens + (now - last) * self._rate)
        ok = tokens >= 1.0
        self._buckets[client] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self._max:
            del self._buckets[next(iter(self._buckets))]  # oldest insertion
        return ok


class RequestHints(NamedTuple):
    hints: list[KvHint | HintOutcome]
    signed: bool  # a router signature verified (an envelope of no actions counts)
    problem: str = ""  # why a signature the request carried did not verify


def read_request(
    params: Mapping[str, Any] | None,
    envelope: Any,
    session_id: Any,
    secret: bytes | None,
) -> RequestHints:
    """Everything a request carries, parsed once: the vLLM envelope (engine API
    ``kv_hints`` wins over ``kv_transfer_params["kv_hints"]``) and KVCR's
    ``kv.fetch``, each marked signed when its router signature verifies, and
    whether any did (a router signs a turn it has no hint for with an envelope
    of no actions). ``session_id``: as the request gave it (None, or anything:
    an invalid id rejects its hints, naming the field). Never raises."""
    params = params if isinstance(params, Mapping) else {}
    out: list[KvHint | HintOutcome] = []
    raw = envelope if envelope is not None else params.get(HINTS_PARAM)
    bad = "" if session_id is None else id_problem(session_id, "session_id")
    if bad:  # the request runs without a session; its hints cannot
        return RequestHints(
            [HintOutcome("kv_hints", None, Status.REJECTED, reason=bad)]
            if raw is not None or params.get(KVCR_PARAM) is not None
            else [],
            False,
        )
    any_signed, problem = False, ""
    if raw is not None:
        if _too_big(raw):  # before its signature: that reads the whole envelope
            out.append(HintOutcome("kv_hints", None, Status.REJECTED, reason=TOO_BIG))
        else:
            sig = params.get(SIG_PARAM)
            problem = "" if sig is None else signature_problem(raw, session_id, sig, secret)
            signed = sig is not None and not problem
            any_signed |= signed
            out += [
                h if isinstance(h, HintOutcome) else _mark(h, signed)
                for h in parse_envelope(raw, session_id)
            ]
    kvcr = params.get(KVCR_PARAM)
    if kvcr is not None:
        if _too_big(kvcr):
            out.append(HintOutcome("kv_hint", None, Status.REJECTED, reason=TOO_BIG))
        else:
            h = parse_kvcr_fetch(kvcr)
            signed = verify(kvcr, session_id, params.get(KVCR_SIG_PARAM), secret)
            any_signed |= signed
            out.append(h if isinstance(h, HintOutcome) else _mark(h, signed))
    return RequestHints(out, any_signed, problem)


def _too_big(raw: Any) -> bool:
    """Whether an envelope (ours or KVCR's, a dict or vLLM's struct) has more
    than ``MAX_ACTIONS`` actions or names more than ``MAX_ENVELOPE_KEYS``
    keys in all: O(actions), before its signature is checked or its keys are
    read on the scheduler thread (64 actions of ``MAX_KEYS`` took 2 s)."""
    actions = raw.get("actions") if isinstance(raw, Mapping) else getattr(raw, "actions", None)
    if not isinstance(actions, list):
        return False
    if len(actions) > MAX_ACTIONS:
        return True
    n = 0
    for a in actions:
        payload = a.get("payload") if isinstance(a, Mapping) else getattr(a, "payload", None)
        if not isinstance(payload, Mapping):
            continue
        target = payload.get("target")
        keys = target.get("keys") if isinstance(target, Mapping) else None
        hashes = payload.get("block_hashes")
        n += (len(keys) if isinstance(keys, list) else 0) + (
            len(hashes) if isinstance(hashes, list) else 0
        )
    return n > MAX_ENVELOPE_KEYS


def read_request_hints(
    params: Mapping[str, Any] | None, envelope: Any, session_id: Any, secret: bytes | None
) -> list[KvHint | HintOutcome]:
    """``read_request``'s hints."""
    return read_request(params, envelope, session_id, secret).hints


def _never(_key: bytes) -> bool:
    return False


def _mark(h: KvHint, signed: bool) -> KvHint:
    return msgspec.structs.replace(h, signed=signed)


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
class _Rest:
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
class _Wait:
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
    then: Callable[[_Wait], HintOutcome] | None = None
    arrived: list[bytes] = field(default_factory=list)
    lost: int = 0
    why: str = ""  # why the last lost chunk was lost
    hold: int = 0  # chunks ``then`` keeps (the bound counts them)
    done: bool = False


class HintExecutor:
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
        self._waits: dict[Tier, dict[bytes, list[_Wait]]] = {Tier.G2: {}, Tier.G3: {}}
        self._waits_of: dict[str, list[_Wait]] = {}  # request id -> its, until request_done
        self._order: deque[_Wait] = deque()  # as registered: by deadline
        self._live = 0  # waits not settled
        self._n_waiting = 0  # chunks waited for
        self._n_held = 0  # chunks waits keep for their copy
        self._rest: deque[_Rest] = deque()  # Pins and Retains past a slice
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
            asked, keys, reason, clipped = len(hint.target.keys), list(hint.target.keys), "", []
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
            self._rest.append(_Rest(hint, session_id, owner, rest, ttl))
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

    # ---- waiting chunks (module docstring) -------------------------------------

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

    def _end_rest(self, r: _Rest, why: str = "") -> None:
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
        then: Callable[[_Wait], HintOutcome] | None = None,
        hold: int = 0,
    ) -> None:
        w = _Wait(
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

    def _unwait(self, w: _Wait, k: bytes) -> None:
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
        got: dict[_Wait, list[bytes]] = {}
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

    def _take(self, w: _Wait, keys: list[bytes]) -> None:
        """Chunks ``w`` waited for are there: pinned or retained now, or kept
        for its ``then``."""
        if w.then is not None:
            w.arrived += keys
            return
        self._act(w, keys)

    def _act(self, part: _Wait | _Rest, keys: list[bytes]) -> None:
        """Pin or retain ``keys`` for ``part`` (a wait's arrived chunks, a
        slice of a large hint's rest); those it cannot are counted in
        ``part.lost``, with why."""
        if part.owner and not self._index.has_session(part.owner):
            part.lost, part.why = part.lost + len(keys), "the session ended"
            return
        present = [k for k in keys if self._policy.get(k) is not None]
        if len(present) < len(keys):
            part.lost, part.why = part.lost + len(keys) - len(present), "not in G2"
        if part.hint.action is Action.RETAIN:
            self._policy.retain(present, part.hint.bounds.priority, part.ttl, part.owner)
            return
        done, _, _ = self._pin(part.hint, part.session, present, part.ttl)
        if len(done) < len(present):
            part.lost, part.why = part.lost + len(present) - len(done), "pin quota"

    def _settle(self, w: _Wait, why: str = "", run: bool = True) -> None:
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

    def _pin_g3(
        self,
        hint: KvHint,
        owner: str,
        keys: list[bytes],
        asked: int,
        clipped: list[str],
        ttl: float,
        g2_blocks: int,
        w: _Wait,
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
    def _reasons(clipped: list[str], w: _Wait | None, *more: str) -> str:
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
            res = self._index.resolve_keys(list(t.keys))
            return (
                len(t.keys),
                res.keys,
                "none of the keys is resident",
                [],
                set(res.per_tier[Tier.G3]),
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
