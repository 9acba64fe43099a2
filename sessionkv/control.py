"""The control channel's wire protocol, shared by the engine and its clients.

Transport: ZMQ. Each engine (each DP rank) binds a ROUTER socket for
request/reply and a PUB socket for its event stream (``sessionkv.events``).
Everything on the wire is msgpack (msgspec); nothing is pickled.

Authentication at the socket: both sockets are CURVE servers, and the engine
admits (ZAP, RFC 27) only the client key pair derived from the cluster secret
(``curve_keys``; ``secure_server`` / ``secure_client``). A peer without the
secret never completes the handshake: ZMQ neither queues its frames nor hands
them to the engine, and a subscriber without it reads no event. The frames'
HMACs below stay: they bind each frame to its purpose, client and time.

Request: two frames ``[payload, mac]``; ``payload`` is a ``ControlRequest``,
``mac`` HMAC-SHA256 over ``REQUEST_DOMAIN + payload`` with the router's shared
secret. ``counter`` must grow per client (clients use ``time.time_ns()``) and lie
within ``REPLAY_WINDOW_S`` of the engine's clock: a replayed or stale frame is
refused. Ops:

- ``hello``: the engine's identity and event endpoint (``ControlReply.info``);
- ``hints``: a ``KvHintsEnvelope`` (JSON form, ``sessionkv.hints``); the
  default target is ``session_id``; one outcome per action;
- ``end_session``: the session ends (its pins and retains are released); one
  outcome (``accepted``, or ``missing`` for an unknown session);
- ``events``: the kept events with ``seq > after`` (at most ``limit``);
- ``resolve``: the chunk keys (G2/G3 object keys) of the blocks named by
  ``block_hashes`` (64-bit, as KV events report them) that the engine holds
  (``ControlReply.keys``, root first), for ``kv.fetch`` on another engine;
- ``probe``: how the engine hashes ``tokens`` (its block hashes, hash
  function, block-hash root, G3 object prefix and health) in
  ``ControlReply.info``, for ``sessionkv doctor``;
- ``status``: sessions with blocks per tier, pins and their expiry, hint
  outcome counts, recent evictions (``ControlReply.info``), for ``sessionkv status``.

Reply: ``[payload, mac]`` with ``REPLY_DOMAIN``; ``counter`` echoes the
request's. A frame refused as a whole (unauthenticated, replayed, oversized,
malformed, rate limited) gets ``ok=False``, ``error`` and one ``rejected``
outcome named ``"frame"``.

Events: three frames ``[kind, payload, mac]`` with ``EVENT_DOMAIN``; the kind
frame is the topic subscribers filter on.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from typing import Any, NamedTuple

import msgspec
import zmq
from zmq.utils import z85

from sessionkv.events import AnyEvent
from sessionkv.hints import HintOutcome, Status
from sessionkv.keys import CONTROL, CURVE_CLIENT, CURVE_SERVER, derive

REQUEST_DOMAIN = b"sessionkv-control-request-v1\n"
REPLY_DOMAIN = b"sessionkv-control-reply-v1\n"
EVENT_DOMAIN = b"sessionkv-event-v1\n"
MAX_FRAME_BYTES = 4 << 20  # larger requests are refused with an outcome
HARD_MAX_FRAME_BYTES = MAX_FRAME_BYTES + (1 << 20)  # ZMQ drops a peer that sends more
ZAP_DOMAIN = b"sessionkv"
REPLAY_WINDOW_S = 60.0
MAX_EVENTS_PER_REPLY = 10_000
OPS = ("hello", "hints", "end_session", "events", "resolve", "probe", "status")
MAX_PROBE_TOKENS = 65_536


class ControlRequest(msgspec.Struct, kw_only=True):
    client: str
    counter: int
    op: str
    engine: str = ""  # the engine_id it is for (every op but hello): a frame
    # captured on one engine does not replay on another
    session_id: str | None = None
    hints: Any = None
    after: int = 0
    limit: int = 1000
    block_hashes: list[int] = []
    tokens: list[int] = []


class ControlReply(msgspec.Struct, kw_only=True):
    counter: int
    ok: bool = True
    error: str = ""
    outcomes: list[HintOutcome] = []
    events: list[AnyEvent] = []
    oldest: int = 0  # op=events: oldest seq still kept
    next_seq: int = 0  # op=events: the next seq the engine assigns
    last_seq: int = 0  # op=events: the page's last event (kept by a
    # client that skips kinds it does not know)
    keys: list[bytes] = []  # op=resolve
    info: dict[str, Any] = {}


def mac(domain: bytes, payload: bytes, secret: bytes) -> bytes:
    """A frame's tag, under the channel's key derived from the cluster secret."""
    return hmac.new(derive(secret, CONTROL), domain + payload, hashlib.sha256).digest()


def authentic(domain: bytes, payload: bytes, tag: bytes, secret: bytes) -> bool:
    return hmac.compare_digest(mac(domain, payload, secret), tag)


class CurveKeys(NamedTuple):
    """Z85 CURVE keys derived from one cluster secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=16)
def curve_keys(secret: bytes) -> CurveKeys:
    """The engines' and the clients' key pairs: any 32 bytes are a Curve25519
    secret key, so each is a derived key and its public half follows."""
    server = z85.encode(derive(secret, CURVE_SERVER))
    client = z85.encode(derive(secret, CURVE_CLIENT))
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def secure_server(sock: zmq.Socket[Any], secret: bytes) -> None:
    """Make ``sock`` (before it binds) a CURVE server whose handshakes the
    context's ZAP handler decides; with no handler every handshake fails."""
    keys = curve_keys(secret)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket[Any], secret: bytes) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the engines."""
    keys = curve_keys(secret)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def zap_reply(frames: list[bytes], secret: bytes) -> tuple[list[bytes], bool]:
    """The answer to one ZAP request (RFC 27) and whether it admits the peer:
    CURVE in our domain with the clients' derived public key, nothing else."""
    if len(frames) < 6:  # not a ZAP request: answer what can be answered
        return [
            b"1.0",
            frames[1] if len(frames) > 1 else b"",
            b"400",
            b"malformed",
            b"",
            b"",
        ], False
    version, request_id, domain, _address, _identity, mechanism, *creds = frames
    ok = (
        version == b"1.0"
        and domain == ZAP_DOMAIN
        and mechanism == b"CURVE"
        and len(creds) == 1
        and hmac.compare_digest(creds[0], z85.decode(curve_keys(secret).client_public))
    )
    return [
        b"1.0",
        request_id,
        b"200" if ok else b"400",
        b"OK" if ok else b"unknown client key",
        b"client" if ok else b"",
        b"",
    ], ok


def refused(counter: int, reason: str) -> ControlReply:
    return ControlReply(
        counter=counter,
        ok=False,
        error=reason,
        outcomes=[HintOutcome("frame", None, Status.REJECTED, reason=reason)],
    )


class ReplayGuard:
    """Accepts each client's counters only increasing and near the clock.
    Remembers the newest ``max_clients`` clients; a forgotten client's old
    frames are still refused once they are older than the window."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, max_clients: int = 4096):
        self._window_ns = int(window_s * 1e9)
        self._max = max_clients
        self._last: dict[str, int] = {}

    def check(self, client: str, counter: int) -> str:
        """ "" when fresh (and remembered), else why not."""
        if abs(counter - time.time_ns()) > self._window_ns:
            return "stale frame: counter outside the replay window (clock skew?)"
        if counter <= self._last.get(client, 0):
            return "replayed frame"
        self._last.pop(client, None)
        self._last[client] = counter
        while len(self._last) > self._max:
            del self._last[next(iter(self._last))]
        return ""


class _ReplyIn(ControlReply, kw_only=True):
    """A reply as a client reads it: each event decoded on its own, so one of
    a kind or shape this client does not know (a newer engine) is skipped."""

    # Raw in place of the base's decoded events, by design (read only here).
    events: list[msgspec.Raw] = []  # type: ignore[assignment]


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(ControlRequest)
_reply_in = msgspec.msgpack.Decoder(_ReplyIn)
_event_in = msgspec.msgpack.Decoder(AnyEvent)


def decode_reply(payload: bytes) -> tuple[ControlReply, int]:
    """A reply and how many of its events were skipped (unknown kinds or
    fields); ``msgspec.DecodeError`` / ``ValidationError`` when the reply
    itself is not one."""
    raw = _reply_in.decode(payload)
    events, skipped = [], 0
    for e in raw.events:
        try:
            events.append(_event_in.decode(e))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    fields = {f: getattr(raw, f) for f in raw.__struct_fields__}
    return ControlReply(**{**fields, "events": events}), skipped
