"""HintExecutor: trust, limits, resolution and one outcome for every hint.

Order for each hint: parse (``sessionkv.hints``) -> trust (a valid router
signature, or an unsigned Pin of the request's own session within the unsigned
quota) -> rate limit per client -> resolution against the SessionPrefixIndex
(``missing`` when nothing resident answers) -> bounds clipped to the limits ->
the action. Actions are the next issues' work: until an action exists its
outcome is ``rejected`` with reason "not implemented", never a false
``accepted``.

Request-borne hints act when their request finishes (the turn's blocks are all
in the index by then); the outcomes go back in that response.

Threading: the scheduler thread (the connector's), like the index it reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

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
    Status,
    parse_envelope,
    parse_kvcr_fetch,
    verify,
)
from sessionkv.index.prefix_index import SessionPrefixIndex

KVCR_SIG_PARAM = "kv_hint_sig"
# Actions whose execution exists; the others answer "not implemented".
IMPLEMENTED: frozenset[Action] = frozenset()


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


def read_request_hints(
    params: Mapping[str, Any] | None, envelope: Any, session_id: str | None,
    secret: bytes | None,
) -> list[KvHint | HintOutcome]:
    """Everything a request carries, parsed once: the vLLM envelope (engine API
    ``kv_hints`` wins over ``kv_transfer_params["kv_hints"]``) and KVCR's
    ``kv.fetch``, each marked signed when its router signature verifies."""
    params = params if isinstance(params, Mapping) else {}
    out: list[KvHint | HintOutcome] = []
    raw = envelope if envelope is not None else params.get(HINTS_PARAM)
    if raw is not None:
        signed = verify(raw, session_id, params.get(SIG_PARAM), secret)
        out += [h if isinstance(h, HintOutcome) else _mark(h, signed)
                for h in parse_envelope(raw, session_id)]
    kvcr = params.get(KVCR_PARAM)
    if kvcr is not None:
        h = parse_kvcr_fetch(kvcr)
        signed = verify(kvcr, session_id, params.get(KVCR_SIG_PARAM), secret)
        out.append(h if isinstance(h, HintOutcome) else _mark(h, signed))
    return out


def _mark(h: KvHint, signed: bool) -> KvHint:
    return KvHint(h.hint_id, h.action, h.target, h.bounds, h.source, signed)


class HintExecutor:
    """Gives every hint one outcome (see the module docstring)."""

    def __init__(
        self,
        index: SessionPrefixIndex,
        limits: Limits,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._index = index
        self._limits = limits
        self._buckets = TokenBuckets(limits.hints_per_s_per_client, clock)

    def execute_all(
        self, items: list[KvHint | HintOutcome], session_id: str | None
    ) -> list[HintOutcome]:
        return [i if isinstance(i, HintOutcome) else self.execute(i, session_id) for i in items]

    def execute(self, hint: KvHint, session_id: str | None) -> HintOutcome:
        name = f"kv.{hint.action.value}"

        def outcome(status: Status, reason: str, asked: int = 0, affected: int = 0):
            return HintOutcome(hint.hint_id, name, status, asked, affected, reason)

        if not hint.signed and not self._unsigned_ok(hint, session_id):
            return outcome(Status.REJECTED, "unsigned: request hints need the router's signature")
        if not self._buckets.take(session_id or "anonymous"):
            return outcome(Status.REJECTED, "rate limit exceeded")

        asked, found, reason = self._resolve(hint)
        if found == 0:
            return outcome(Status.MISSING, reason, asked)
        clipped = []
        limit = min(self._limits.max_blocks_per_hint, hint.bounds.max_blocks or found)
        if found > limit:
            clipped.append(f"blocks clipped to {limit}")
        ttl = hint.bounds.ttl_s
        if ttl is not None and ttl > self._limits.max_ttl_s:
            clipped.append(f"ttl clipped to {self._limits.max_ttl_s:g} s")
        if hint.action not in IMPLEMENTED:
            return outcome(Status.REJECTED, "not implemented", asked)
        return outcome(Status.CLIPPED if clipped else Status.ACCEPTED,
                       "; ".join(clipped), asked, min(found, limit))

    def _unsigned_ok(self, hint: KvHint, session_id: str | None) -> bool:
        """Unsigned Pins of the request's own session, when the operator
        enabled their separate quota."""
        t = hint.target
        return (hint.action is Action.PIN and self._limits.unsigned_pin_fraction > 0
                and not isinstance(t, (KeysTarget, HashesTarget))
                and session_id is not None and t.session_id == session_id)

    def _resolve(self, hint: KvHint) -> tuple[int, int, str]:
        """(blocks the hint asks for, blocks resident now, reason when none)."""
        t = hint.target
        if isinstance(t, HashesTarget):
            n = len(t.block_hashes)                 # blocks to fetch into this engine
            return n, n, ""
        if isinstance(t, KeysTarget):
            n = len(self._index.resolve_keys(list(t.keys)).keys)
            return len(t.keys), n, "none of the keys is resident"
        res = self._index.resolve_session(t.session_id, t.branch, t.boundary)
        if res is None:
            if self._index.is_ended(t.session_id):
                return 0, 0, "session ended"
            if not self._index.has_session(t.session_id):
                return 0, 0, "unknown session"
            return 0, 0, "branch or boundary is not part of the session"
        return len(res.keys), len(res.keys), "session has no resident blocks"
