"""HintExecutor: trust, limits, resolution and one outcome for every hint.

Order for each hint: parse (``sessionkv.hints``) -> trust (a valid router
signature, or an unsigned Pin of the request's own session within the unsigned
quota) -> rate limit per client -> resolution against the SessionPrefixIndex
(``missing`` when nothing resident answers) -> bounds clipped to the limits ->
the action. Pin and Retain act on G2 through ``SessionCachePolicy`` (pin quotas
per session, global, and a separate unsigned pool, as fractions of G2). Demote,
Prefetch and Share are copies between G2 and G3 (``connectors.moves.Mover``):
they answer ``deferred`` and get their final outcome when the copy ended (on
the event stream). A Prefetch naming exact keys fetches them from G3 even when
this engine never saw them (the receiving side of a Share). Pins the policy
later clips under pressure come back from ``collect_clipped`` as ``clipped``.

Request-borne hints act when their request finishes (the turn's blocks are all
in the index by then); the outcomes go back in that response. Control-channel
hints (authenticated by the channel, so treated as signed) act at once.
``release(session)`` drops what an ended session pinned and retained.

Cost: the pin book (``PinBook``) is indexed by owner and counted per pool, and
lapses come from the policy (``take_unpinned``): a hint costs its own chunks
and a session's end its own pins, never a pass over every live pin.

Threading: callers hold the tier manager's lock (the scheduler thread during
its pass, or any other thread); it only changes metadata.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from sessionkv.config import Limits
from sessionkv.hints import (
    HINTS_PARAM,
    KVCR_PARAM,
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
    verify,
)
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2_policy import SessionCachePolicy

from .fetch import Fetcher
from .moves import Mover

KVCR_SIG_PARAM = "kv_hint_sig"
MAX_CLIPPED_HINTS = 4096   # clipped outcomes waiting for collect_clipped (one per hint)
# A Retain up to a boundary the index no longer holds took the session's
# deepest branch: clipped, since what was evicted is not held.
BOUNDARY_GONE = "boundary evicted: the session's deepest branch"


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
            del self._buckets[next(iter(self._buckets))]   # oldest insertion
        return ok


class RequestHints(NamedTuple):
    hints: list[KvHint | HintOutcome]
    signed: bool        # a router signature verified (an envelope of no actions counts)


def read_request(
    params: Mapping[str, Any] | None, envelope: Any, session_id: Any,
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
    if bad:                 # the request runs without a session; its hints cannot
        return RequestHints([HintOutcome("kv_hints", None, Status.REJECTED, reason=bad)]
                            if raw is not None or params.get(KVCR_PARAM) is not None else [],
                            False)
    any_signed = False
    if raw is not None:
        signed = verify(raw, session_id, params.get(SIG_PARAM), secret)
        any_signed |= signed
        out += [h if isinstance(h, HintOutcome) else _mark(h, signed)
                for h in parse_envelope(raw, session_id)]
    kvcr = params.get(KVCR_PARAM)
    if kvcr is not None:
        h = parse_kvcr_fetch(kvcr)
        signed = verify(kvcr, session_id, params.get(KVCR_SIG_PARAM), secret)
        any_signed |= signed
        out.append(h if isinstance(h, HintOutcome) else _mark(h, signed))
    return RequestHints(out, any_signed)


def read_request_hints(params: Mapping[str, Any] | None, envelope: Any, session_id: Any,
                       secret: bytes | None) -> list[KvHint | HintOutcome]:
    """``read_request``'s hints."""
    return read_request(params, envelope, session_id, secret).hints


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


class HintExecutor:
    """Gives every hint one outcome (see the module docstring).

    ``mover``: the G2 <-> G3 copies (None without a G3 tier: Demote, Prefetch
    and Share are rejected); ``fetcher``: kv.fetch (None without a G3 tier
    and a control secret)."""

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
        self._clipped: dict[str, int] = {}      # hint id -> its chunks clipped, not yet told
        self._mover = mover
        self._fetcher = fetcher

    def execute_all(
        self, items: list[KvHint | HintOutcome], session_id: str | None,
        client: str | None = None,
    ) -> list[HintOutcome]:
        return [i if isinstance(i, HintOutcome) else self.execute(i, session_id, client)
                for i in items]

    def execute(self, hint: KvHint, session_id: str | None,
                client: str | None = None) -> HintOutcome:
        """One hint's outcome. ``session_id`` is the request's (or the control
        request's) session; ``client`` names the rate-limit bucket (default:
        the session)."""
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
                return outcome(Status.REJECTED, "kv.fetch needs a G3 tier and a control "
                               "secret the source trusts", asked)
            if asked > limit:
                return outcome(Status.REJECTED, f"kv.fetch of more than {limit} blocks", asked)
            return self._fetcher.start(hint)
        if hint.action is Action.PREFETCH and isinstance(hint.target, KeysTarget):
            asked, keys, reason, clipped = len(hint.target.keys), list(hint.target.keys), "", []
        else:
            asked, keys, reason, clipped = self._resolve(hint)
        if not keys:
            return outcome(Status.MISSING, reason, asked)
        limit = min(self._limits.max_blocks_per_hint, hint.bounds.max_blocks or len(keys))
        if len(keys) > limit:
            clipped.append(f"blocks clipped to {limit}")
            keys = keys[:limit]                  # the prefix first: what a turn reuses
        ttl = hint.bounds.ttl_s
        if ttl is not None and ttl > self._limits.max_ttl_s:
            clipped.append(f"ttl clipped to {self._limits.max_ttl_s:g} s")
            ttl = self._limits.max_ttl_s
        if hint.action in (Action.DEMOTE, Action.PREFETCH, Action.SHARE):
            if self._mover is None:
                return outcome(Status.REJECTED, "Demote, Prefetch and Share need a G3 tier",
                               asked)
            if not isinstance(hint.target, KeysTarget) or hint.action is not Action.PREFETCH:
                keys = self._index.chunk_keys(keys, self._bpc)
            return self._mover.start(hint.action, hint.hint_id, keys, asked,
                                    self._owner(hint, session_id), "; ".join(clipped))
        if hint.action not in (Action.PIN, Action.RETAIN):
            return outcome(Status.REJECTED, "not implemented", asked)
        if self._policy is None:
            return outcome(Status.REJECTED, "Pin and Retain need g2.eviction: session", asked)
        chunks = [k for k in keys if self._policy.get(k) is not None]
        # A Pin also holds the target's objects in G3 (the backend's own pins).
        g3 = (self._mover.in_g3(self._index.chunk_keys(keys, self._bpc))
              if hint.action is Action.PIN and self._mover is not None else [])
        if not chunks and not g3:
            return outcome(Status.MISSING, "none of the target is in G2", asked)
        if hint.action is Action.PIN and ttl is None:
            ttl = self._limits.max_ttl_s
        if hint.action is Action.RETAIN:
            self._policy.retain(chunks, hint.bounds.priority, ttl, self._owner(hint, session_id))
            done = chunks
        else:
            done, why = self._pin(hint, session_id, chunks, ttl)
            if why:
                clipped.append(why)
        affected = self._blocks_in(done, keys)
        if g3:
            return self._mover.start(Action.PIN, hint.hint_id, g3, asked,
                                    self._owner(hint, session_id), "; ".join(clipped),
                                    ttl_s=ttl, g2_blocks=affected)
        status = Status.CLIPPED if clipped else Status.ACCEPTED
        return outcome(status, "; ".join(clipped), asked, affected)

    def _blocks_in(self, chunks: list[bytes], keys: list[bytes]) -> int:
        """How many of ``keys`` (blocks) the G2 ``chunks`` (keyed by their last block) hold."""
        if self._bpc == 1:
            return len(chunks)
        wanted = set(keys)
        return sum(len(wanted.intersection(self._index.chain_to(c, self._bpc))) for c in chunks)

    def _pin(self, hint: KvHint, session_id: str | None, chunks: list[bytes],
             ttl: float) -> tuple[list[bytes], str]:
        """Pin within the quotas: (chunks pinned, clip reason or "")."""
        owner = self._owner(hint, session_id)
        self._forget_lapsed()
        mine = self._pins.of(owner)
        pool = self._pins.pooled(hint.signed)
        if hint.signed:
            room = min(self._cap_session - len(mine), self._cap_global - pool)
        else:
            room = self._cap_unsigned - pool
        new = [k for k in chunks if k not in self._pins]
        take = new[:max(room, 0)]
        again = [k for k in chunks if k in mine]      # re-pinning extends the TTL
        self._policy.pin(again + take, ttl)
        # Only what the policy pinned (a chunk gone from G2 meanwhile is not):
        # the book holds no pin the policy will never report ended.
        take = [k for k in take if self._policy.pin_expiry(k) is not None]
        for k in take:
            self._pins.add(k, owner, hint.hint_id, hint.signed)
        lost = len(new) - len(take)
        return again + take, (f"pin quota: {lost} chunks not pinned" if lost else "")

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
        return [{"session_id": o, "hint_id": h, "chunks": len(left),
                 "expires_in_s": [round(min(left), 3), round(max(left), 3)]}
                for (o, h), left in sorted(groups.items())]

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
                while len(self._clipped) > MAX_CLIPPED_HINTS:    # nobody collects them
                    del self._clipped[next(iter(self._clipped))]

    def collect_clipped(self) -> list[HintOutcome]:
        """Pins the policy clipped under G2 pressure since the last call, one
        ``clipped`` outcome per hint; the owner calls this every step, so the
        policy's sets stay small."""
        if self._policy is None or not (self._pins or self._clipped):
            return []       # the policy reports only pins booked here (most steps: none)
        self._forget_lapsed()
        lost, self._clipped = self._clipped, {}
        return [HintOutcome(hint_id, Action.PIN.action_type, Status.CLIPPED, 0, n,
                            f"{n} pinned chunks evicted: G2 had nothing else left")
                for hint_id, n in lost.items()]

    def _unsigned_ok(self, hint: KvHint, session_id: str | None) -> bool:
        """Unsigned Pins of the request's own session, when the operator
        enabled their separate quota."""
        t = hint.target
        return (hint.action is Action.PIN and self._limits.unsigned_pin_fraction > 0
                and not isinstance(t, (KeysTarget, HashesTarget))
                and session_id is not None and t.session_id == session_id)

    def _resolve(self, hint: KvHint) -> tuple[int, list[bytes], str, list[str]]:
        """(blocks the hint asks for, resident block keys root first, reason
        when none, what clipped the target)."""
        t = hint.target
        if isinstance(t, KeysTarget):
            keys = self._index.resolve_keys(list(t.keys)).keys
            return len(t.keys), keys, "none of the keys is resident", []
        res = self._index.resolve_session(t.session_id, t.branch, t.boundary)
        if res is None and hint.action is Action.RETAIN and t.boundary is not None \
                and t.boundary not in self._index:
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
                    return len(res.keys), res.keys, "", [BOUNDARY_GONE]
        if res is None:
            if self._index.is_ended(t.session_id):
                return 0, [], "session ended", []
            if not self._index.has_session(t.session_id):
                return 0, [], "unknown session", []
            return 0, [], "branch or boundary is not part of the session", []
        return len(res.keys), res.keys, "session has no resident blocks", []
