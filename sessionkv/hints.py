"""KvHints: the types, the wire forms, and the router signature.

A hint is target + action + bounds. Wire forms:

- vLLM's ``KvHintsEnvelope`` (protocol "1.0"), one ``KvHintAction`` per hint,
  ``action_type`` ``kv.pin | kv.retain | kv.demote | kv.prefetch | kv.share``,
  ``action_version`` "1.0", payload::

      {"target": {"session_id": "s1", "branch": "<hex key>", "boundary": "<hex key>"}
                 | {"keys": ["<hex key>", ...]},     # default: the request's session
       "ttl_s": 30, "priority": 5, "destination": "worker-b", "max_blocks": 512}

  It arrives as ``ReqContext.kv_hints`` (Python engine API) or
  ``kv_transfer_params["kv_hints"]`` (HTTP).
- KVCR's ``kv.fetch`` in KVCR's own schema (``kv_transfer_params["kv_hint"]``,
  protocol "0.1", 64-bit ``block_hashes``, ``source_control_endpoint``): a Share
  into this engine.

Request-borne hints must be signed by the router: ``kv_transfer_params
["kv_hints_sig"] = sign(envelope, session_id, secret)``, an HMAC-SHA256 over the
envelope's canonical JSON, the session id and an expiry (``SIG_TTL_S``).

Parsing never raises: every action yields one ``KvHint`` or one ``rejected``
``HintOutcome``; an envelope that cannot be read at all yields one outcome.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from enum import Enum
from typing import Any, Literal, overload

import msgspec

from sessionkv.keys import HINT_SIG, derive

PROTOCOL_VERSION = "1.0"
ACTION_VERSION = "1.0"
KVCR_PROTOCOL_VERSION = "0.1"
KVCR_FETCH = "kv.fetch"
MAX_ACTIONS = 64  # per envelope; more is refused as a whole
MAX_ID_LEN = 128
MAX_KEYS = 65_536  # per target
MAX_ENDPOINT_LEN = 512
SIG_TTL_S = 300.0  # a request signature's lifetime
SIG_MAX_AHEAD_S = 3600.0  # expiries further ahead are refused (clock skew fits inside)
# C0 and C1 controls (NUL included) and lone surrogates: not valid in an
# HTTP header, a log line or UTF-8 (an outcome with one could not be encoded).
_NOT_IN_IDS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
HINTS_PARAM = "kv_hints"
SIG_PARAM = "kv_hints_sig"
KVCR_PARAM = "kv_hint"


class Action(str, Enum):
    PIN = "pin"
    RETAIN = "retain"
    DEMOTE = "demote"
    PREFETCH = "prefetch"
    SHARE = "share"

    @property
    def action_type(self) -> str:
        """The action's name on the wire and in outcomes: ``kv.<action>``."""
        return f"kv.{self.value}"


ACTION_TYPES = {a.action_type: a for a in Action}


class Status(str, Enum):
    ACCEPTED = "accepted"
    CLIPPED = "clipped"
    DEFERRED = "deferred"  # a final outcome follows later
    REJECTED = "rejected"
    MISSING = "missing"


class SessionTarget(msgspec.Struct, frozen=True, tag="session"):
    """A session, one of its branches (by frontier key), or its prefix up to a key."""

    session_id: str
    branch: bytes | None = None
    boundary: bytes | None = None


class KeysTarget(msgspec.Struct, frozen=True, tag="keys"):
    """An exact set of blocks (OffloadKey bytes)."""

    keys: tuple[bytes, ...]


class HashesTarget(msgspec.Struct, frozen=True, tag="hashes"):
    """Blocks named by 64-bit hashes (KVCR's ``block_hashes``)."""

    block_hashes: tuple[int, ...]


Target = SessionTarget | KeysTarget | HashesTarget


class Bounds(msgspec.Struct, frozen=True):
    ttl_s: float | None = None
    priority: int = 0
    destination: str | None = None
    max_blocks: int | None = None


class KvHint(msgspec.Struct, frozen=True):
    hint_id: str
    action: Action
    target: Target
    bounds: Bounds = Bounds()
    source: str | None = None  # where Share data comes from (KVCR's endpoint)
    signed: bool = False


class HintOutcome(msgspec.Struct, frozen=True):
    """What became of one hint. ``deferred`` is followed by one final outcome."""

    hint_id: str
    action: str | None
    status: Status
    blocks_asked: int = 0
    blocks_affected: int = 0
    reason: str = ""


def canonical(envelope: Any) -> bytes:
    """The bytes a signature covers: JSON with sorted keys, no spaces, UTF-8."""
    if isinstance(envelope, msgspec.Struct):
        envelope = msgspec.to_builtins(envelope)
    return json.dumps(
        envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def sign(
    envelope: Any,
    session_id: str,
    secret: bytes,
    *,
    ttl_s: float = SIG_TTL_S,
    now: float | None = None,
) -> str:
    """The router's signature over an envelope, the request's session id and
    an expiry (``ttl_s`` from now, Unix time): ``"<expiry>.<hex HMAC>"``; send
    it as ``kv_transfer_params["kv_hints_sig"]``. A captured request so
    replays its hints for at most ``ttl_s``. Raises ``TypeError`` /
    ``ValueError`` for an envelope that is not JSON or a session id that is
    not valid UTF-8."""
    exp = int((time.time() if now is None else now) + ttl_s)
    return f"{exp}.{_sig_mac(envelope, session_id, secret, exp)}"


def _sig_mac(envelope: Any, session_id: str, secret: bytes, exp: int) -> str:
    msg = canonical(envelope) + b"\n" + session_id.encode() + b"\n" + str(exp).encode()
    return hmac.new(derive(secret, HINT_SIG), msg, hashlib.sha256).hexdigest()


def verify(
    envelope: Any,
    session_id: str | None,
    signature: Any,
    secret: bytes | None,
    now: float | None = None,
) -> bool:
    """Whether ``signature`` is the router's over these and has not expired
    (nor expires more than ``SIG_MAX_AHEAD_S`` ahead). Never raises."""
    return not signature_problem(envelope, session_id, signature, secret, now)


def signature_problem(
    envelope: Any,
    session_id: str | None,
    signature: Any,
    secret: bytes | None,
    now: float | None = None,
) -> str:
    """ "" when ``verify`` holds, else why not: a signature outside its time
    window names the skew, the usual cause being clocks apart. Never raises."""
    if signature is None:
        return "no signature"
    if not secret:
        return "this engine has no trust.secret_file"
    if not isinstance(signature, str) or not isinstance(session_id, str):
        return "a signature needs a string and a session id"
    exp_s, dot, tag = signature.partition(".")
    if not dot or not (exp_s.isascii() and exp_s.isdigit()) or len(exp_s) > 12:
        return "a malformed signature"
    exp, now = int(exp_s), time.time() if now is None else now
    if not now <= exp <= now + SIG_MAX_AHEAD_S:
        late = now - exp if now > exp else exp - now - SIG_MAX_AHEAD_S
        side = "expired" if now > exp else "expires too far ahead"
        return (
            f"the signature {side} by {late:.0f} s on this engine's clock: "
            f"are the router's and the engine's clocks apart?"
        )
    try:
        want = _sig_mac(envelope, session_id, secret, exp)
    except (TypeError, ValueError, RecursionError):
        return "the envelope is not canonical JSON"
    # As bytes: compare_digest refuses str with non-ASCII characters.
    if hmac.compare_digest(want.encode(), tag.encode("utf-8", "surrogatepass")):
        return ""
    return "the signature does not match (another secret or session?)"


def id_problem(value: Any, field: str, max_len: int = MAX_ID_LEN) -> str:
    """ "" when ``value`` is a valid identifier (session, hint, action, client
    id, endpoint: 1..``max_len`` characters of valid UTF-8, no control
    characters), else why not, naming ``field``. The one check on every path."""
    if not isinstance(value, str):
        return f"{field} must be a string"
    if not 0 < len(value) <= max_len:
        return f"{field} must be 1..{max_len} characters"
    if _NOT_IN_IDS.search(value):
        return f"{field} must not hold control characters or surrogates"
    return ""


def is_id(value: Any, max_len: int = MAX_ID_LEN) -> bool:
    return not id_problem(value, "", max_len)


def _rejected(hint_id: str, action: str | None, reason: str) -> HintOutcome:
    return HintOutcome(hint_id, action, Status.REJECTED, reason=reason)


def _short_id(value: Any, fallback: str) -> str:
    return value if is_id(value) else fallback


def _hex_key(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or len(value) > 256:
        raise ValueError(f"{where} must be a hex key")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{where} must be a hex key") from None


@overload
def _number(value: Any, where: str, integer: Literal[True]) -> int | None: ...
@overload
def _number(value: Any, where: str, integer: Literal[False] = False) -> float | None: ...
def _number(value: Any, where: str, integer: bool = False) -> float | int | None:
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{where} must be a {'integer' if integer else 'number'}")
    if value < 0:
        raise ValueError(f"{where} must be >= 0")
    number: float | int = value  # checked above
    return number


def _target(payload: Mapping[str, Any], session_id: str | None) -> Target:
    raw = payload.get("target")
    if raw is None:
        if session_id is None:
            raise ValueError("no target and the request has no session_id")
        bad = id_problem(session_id, "session_id")
        if bad:
            raise ValueError(bad)
        return SessionTarget(session_id)
    if not isinstance(raw, Mapping):
        raise ValueError("target must be an object")
    if "keys" in raw:
        keys = raw["keys"]
        if set(raw) != {"keys"} or not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
            raise ValueError(f"target.keys must be a list of 1..{MAX_KEYS} hex keys")
        return KeysTarget(tuple(_hex_key(k, "target.keys[]") for k in keys))
    unknown = set(raw) - {"session_id", "branch", "boundary"}
    if unknown:
        raise ValueError(f"unknown target field {sorted(unknown)[0]!r}")
    sid = raw.get("session_id", session_id)
    bad = id_problem(sid, "target.session_id")
    if bad:
        raise ValueError(bad)
    if raw.get("branch") is not None and raw.get("boundary") is not None:
        raise ValueError("target takes a branch or a boundary, not both")
    branch = None if raw.get("branch") is None else _hex_key(raw["branch"], "target.branch")
    boundary = None if raw.get("boundary") is None else _hex_key(raw["boundary"], "target.boundary")
    return SessionTarget(sid, branch, boundary)


def _bounds(payload: Mapping[str, Any]) -> Bounds:
    priority = _number(payload.get("priority"), "priority", integer=True) or 0
    if priority > 1_000_000:
        raise ValueError("priority must be <= 1000000")
    dest = payload.get("destination")
    bad = "" if dest is None else id_problem(dest, "destination")
    if bad:
        raise ValueError(bad)
    max_blocks = _number(payload.get("max_blocks"), "max_blocks", integer=True)
    if max_blocks == 0:
        raise ValueError("max_blocks must be > 0")
    return Bounds(_number(payload.get("ttl_s"), "ttl_s"), priority, dest, max_blocks)


PAYLOAD_FIELDS = {"target", "ttl_s", "priority", "destination", "max_blocks"}


def _action(i: int, raw: Any, session_id: str | None) -> KvHint | HintOutcome:
    if not isinstance(raw, Mapping):
        return _rejected(f"#{i}", None, "action must be an object")
    aid = raw.get("action_id")
    hint_id = _short_id(aid, f"#{i}")
    atype = raw.get("action_type")
    # Outcomes name only known actions: the name becomes a metric label.
    name = atype if isinstance(atype, str) and atype in ACTION_TYPES else None
    if hint_id != aid:
        return _rejected(hint_id, name, f"action_id must be a string of 1..{MAX_ID_LEN} chars")
    if name is None:
        shown = atype if is_id(atype) else type(atype).__name__
        return _rejected(hint_id, None, f"unknown action_type {shown!r}")
    if raw.get("action_version") != ACTION_VERSION:
        return _rejected(hint_id, name, f"unsupported action_version; supported {ACTION_VERSION!r}")
    payload = raw.get("payload")
    if not isinstance(payload, Mapping):
        return _rejected(hint_id, name, "payload must be an object")
    unknown = set(payload) - PAYLOAD_FIELDS
    if unknown:
        return _rejected(hint_id, name, f"unknown payload field {sorted(map(str, unknown))[0]!r}")
    try:
        return KvHint(hint_id, ACTION_TYPES[name], _target(payload, session_id), _bounds(payload))
    except ValueError as e:
        return _rejected(hint_id, name, str(e))


def parse_envelope(raw: Any, session_id: str | None) -> list[KvHint | HintOutcome]:
    """An envelope (a ``KvHintsEnvelope`` or its JSON form) -> one hint or one
    rejected outcome per action; one outcome when the envelope is unreadable."""
    if isinstance(raw, msgspec.Struct):
        raw = msgspec.to_builtins(raw)
    if not isinstance(raw, Mapping):
        return [_rejected("envelope", None, "kv_hints must be an envelope object")]
    env_id = _short_id(raw.get("message_id"), "envelope")
    if raw.get("protocol_version") != PROTOCOL_VERSION:
        return [
            _rejected(env_id, None, f"unsupported protocol_version; supported {PROTOCOL_VERSION!r}")
        ]
    actions = raw.get("actions")
    if not isinstance(actions, list):
        return [_rejected(env_id, None, "actions must be a list")]
    if len(actions) > MAX_ACTIONS:
        return [_rejected(env_id, None, f"more than {MAX_ACTIONS} actions")]
    return [_action(i, a, session_id) for i, a in enumerate(actions)]


def parse_kvcr_fetch(raw: Any) -> KvHint | HintOutcome:
    """KVCR's envelope -> a Share into this engine of its first ``kv.fetch``."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("actions"), list):
        return _rejected("kv_hint", KVCR_FETCH, "kv_hint must be a KVCR envelope")
    env_id = _short_id(raw.get("message_id"), "kv_hint")
    if raw.get("protocol_version") != KVCR_PROTOCOL_VERSION:
        return _rejected(
            env_id, KVCR_FETCH, f"unsupported protocol_version; supported {KVCR_PROTOCOL_VERSION!r}"
        )
    fetch = next(
        (
            a
            for a in raw["actions"][:MAX_ACTIONS]
            if isinstance(a, Mapping) and a.get("action_type") == KVCR_FETCH
        ),
        None,
    )
    if fetch is None:
        return _rejected(env_id, KVCR_FETCH, "no kv.fetch action")
    hint_id = _short_id(fetch.get("action_id"), env_id)
    payload = fetch.get("payload")
    if not isinstance(payload, Mapping):
        return _rejected(hint_id, KVCR_FETCH, "payload must be an object")
    source = payload.get("source_control_endpoint")
    hashes = payload.get("block_hashes")
    bad = id_problem(source, "source_control_endpoint", MAX_ENDPOINT_LEN)
    if bad:
        return _rejected(hint_id, KVCR_FETCH, bad)
    if payload.get("mode", "copy") != "copy":
        return _rejected(hint_id, KVCR_FETCH, "only copy mode is supported")
    if (
        not isinstance(hashes, list)
        or not 0 < len(hashes) <= MAX_KEYS
        or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in hashes
        )
    ):
        return _rejected(hint_id, KVCR_FETCH, "block_hashes must be 1.. 64-bit integers")
    return KvHint(
        hint_id,
        Action.SHARE,
        HashesTarget(tuple(dict.fromkeys(hashes))),
        Bounds(destination="self"),
        source=source,
    )


def hint_action(
    action: Action | str,
    *,
    session_id: str | None = None,
    branch: bytes | None = None,
    boundary: bytes | None = None,
    keys: list[bytes] | None = None,
    ttl_s: float | None = None,
    priority: int | None = None,
    destination: str | None = None,
    max_blocks: int | None = None,
    action_id: str | None = None,
) -> dict[str, Any]:
    """One ``KvHintAction`` in its JSON form (what routers and clients send).
    The target is ``keys`` when given, else the session (by default the
    request's own), optionally one branch or a prefix up to ``boundary``."""
    action = Action(action)
    if keys is not None:
        target: dict[str, Any] | None = {"keys": [k.hex() for k in keys]}
    else:
        target = {
            k: v
            for k, v in (
                ("session_id", session_id),
                ("branch", branch and branch.hex()),
                ("boundary", boundary and boundary.hex()),
            )
            if v is not None
        }
    payload = {
        k: v
        for k, v in (
            ("target", target or None),
            ("ttl_s", ttl_s),
            ("priority", priority),
            ("destination", destination),
            ("max_blocks", max_blocks),
        )
        if v is not None
    }
    return {
        "action_id": action_id or f"{action.value}-{uuid.uuid4().hex[:12]}",
        "action_type": action.action_type,
        "action_version": ACTION_VERSION,
        "payload": payload,
    }


def envelope(*actions: Mapping[str, Any], message_id: str | None = None) -> dict[str, Any]:
    """A ``KvHintsEnvelope`` in its JSON form around ``actions``."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id or f"m-{uuid.uuid4().hex[:12]}",
        "actions": list(actions),
    }
