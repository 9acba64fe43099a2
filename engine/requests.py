"""What a request carries to the engine: its ``kv_transfer_params`` read
into hints (``read_request``: an envelope, its router signature, a kv.fetch),
bounded before parsing, and each client's hint rate (``TokenBuckets``).

Pure functions of their input but for ``TokenBuckets``, whose callers hold
the session service's lock. Cost: O(size of the request's hint fields).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec

from sessionkv.hints import (
    HINTS_PARAM,
    KVCR_PARAM,
    MAX_ACTIONS,
    MAX_KEYS,
    SIG_PARAM,
    HintOutcome,
    KvHint,
    Status,
    id_problem,
    parse_envelope,
    parse_kvcr_fetch,
    signature_problem,
    verify,
)

KVCR_SIG_PARAM = "kv_hint_sig"
MAX_ENVELOPE_KEYS = MAX_KEYS  # keys in all of a request envelope's targets
TOO_BIG = f"an envelope has at most {MAX_ACTIONS} actions naming {MAX_ENVELOPE_KEYS} keys in all"


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


def _mark(h: KvHint, signed: bool) -> KvHint:
    return msgspec.structs.replace(h, signed=signed)
