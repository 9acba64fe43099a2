"""``ControlChannel``: the engine side of the control channel and event stream.

Started by the scheduler-role ``SessionTierConnector`` only (vLLM builds the
spec in workers too), when the policy names a secret; the wire protocol is in
``sessionkv.control``.

One daemon thread owns both ZMQ sockets. It sleeps in ``poll`` (no timeout)
on the request socket, the event log's wake pipe, the mover's wake pipe and a
stop pipe, so an idle engine stays idle. A vLLM engine with no requests runs
no steps, so this thread applies hints itself, under the session service's lock:
metadata (pins, priorities, TTLs, session ends), and the start and finish of
Demote/Prefetch/Share copies (``engine.mover``: reservations through the
primary tier, the copy itself on the G3 tier's threads); it never calls
``lookup`` (docs/design/architecture.md, "State and threads"). The reply is sent after the hint took
effect: a request sent after the reply sees it.

Authentication at the socket (``sessionkv.control``): both sockets are
CURVE servers and this thread answers their ZAP requests, admitting only the
client key derived from the secret. A peer without the secret costs one
refused handshake (at most ``HANDSHAKE_MS`` of a connection) and never a
queued frame: before CURVE, four peers sending 4 MiB of garbage each grew an
engine by 513 MiB and delayed real hints behind them.

Bounds, per admitted peer: ZMQ queues at most ``RECV_FRAMES`` requests (then
the sender blocks or drops, per its socket), requests over
``MAX_FRAME_BYTES`` get a ``rejected`` outcome and ZMQ disconnects peers over
``HARD_MAX_FRAME_BYTES``; each client gets ``rate`` requests per second and,
separately, ``rate`` hints per second (the hint executor's buckets). ROUTER
sockets queue fairly between peers, so one client's flood delays the others
by at most its share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import zmq

from sessionkv import control as wire
from sessionkv.engine.requests import TokenBuckets
from sessionkv.engine.service import SessionService
from sessionkv.events import Via
from sessionkv.events import encode as encode_event
from sessionkv.hints import MAX_KEYS, HintOutcome, Status, id_problem, parse_envelope

logger = logging.getLogger(__name__)
QUEUE_FRAMES = 1024  # frames sent and not yet taken, per peer
RECV_FRAMES = 64  # requests received and not yet served, per peer
HANDSHAKE_MS = 2000  # a connection that does not finish its handshake by then is dropped
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27, one per ZMQ context
BATCH = 64  # requests handled before the event log gets a turn


class ControlChannel:
    """Request/reply (ROUTER) and event stream (PUB) of one engine (one DP rank)."""

    def __init__(
        self,
        service: SessionService,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        info: dict[str, Any] | None = None,
        rate: float = 100.0,
        clock: Callable[[], float] | None = None,
        probe: Callable[[list[int]], dict[str, Any]] | None = None,
    ):
        if service.event_log is None:
            raise ValueError("the service must have an event log (the policy names a secret)")
        self._service = service
        self._probe = probe
        self._events = service.event_log
        self._secret = secret
        self._guard = wire.ReplayGuard()
        self._frames = TokenBuckets(rate, clock or time.monotonic)
        self._ctx = zmq.Context(io_threads=1)
        try:
            self._zap = self._ctx.socket(zmq.REP)  # bound before any socket can handshake
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.RCVHWM, RECV_FRAMES)
            self._router.setsockopt(zmq.MAXMSGSIZE, wire.HARD_MAX_FRAME_BYTES)
            self._pub = self._socket(zmq.PUB)
            self.endpoint = _bind(self._router, host, port)
            self.events_endpoint = _bind(self._pub, host, port + 1 if port else 0)
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self.info = {**(info or {}), "events": self.events_endpoint}
        self._engine_id = str(self.info.get("engine_id") or "")
        self.dropped_events = 0  # events that could not be encoded (not published)
        self.peers = {"admitted": 0, "refused": 0}  # CURVE handshakes, by ZAP answer
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="sessionkv-control", daemon=True)
        self._closed = False

    def _socket(self, kind: int) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, QUEUE_FRAMES)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        wire.secure_server(s, self._secret)
        return s

    def start(self) -> ControlChannel:
        self._thread.start()
        return self

    def write_endpoint_file(self, path: str) -> None:
        """Publish the endpoints as JSON (atomically: a reader never sees half),
        through a temporary file of an unpredictable name made with
        ``O_EXCL`` (never one planted, nor a link followed); readable by all,
        as it holds no secret."""
        folder, name = os.path.split(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                f.write(json.dumps({"control": self.endpoint, **self.info}))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._ctx.destroy(linger=0)

    # ---- the thread ------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._events.wake_fd, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        wake = self._service.wake
        poller.register(wake.fd, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            if self._zap in ready:
                self._admit()
            if self._router in ready:
                for _ in range(BATCH):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self._serve(frames)
            if wake.fd in ready:
                wake.drain()
                t0 = time.perf_counter()
                try:
                    with self._service.lock:  # hint work waits: go on with it
                        self._service.apply_moves()
                except Exception:  # a bug costs these copies' outcomes, never the thread
                    logger.exception("sessionkv: finishing hint copies failed")
                self._service.stats.control_work("moves", time.perf_counter() - t0)
            if self._events.wake_fd in ready:
                self._publish()

    def _admit(self) -> None:
        """Answer one ZAP request (a peer's CURVE handshake)."""
        try:
            reply, ok = wire.zap_reply(self._zap.recv_multipart(zmq.NOBLOCK), self._secret)
            self.peers["admitted" if ok else "refused"] += 1
            self._zap.send_multipart(reply)
        except zmq.ZMQError:
            pass

    def _publish(self) -> None:
        for ev in self._events.drain_new():
            try:
                payload = encode_event(ev)
            except Exception:  # unencodable (a bug upstream): dropped and counted
                self.dropped_events += 1
                logger.exception("sessionkv: event %d not published", ev.seq)
                continue
            tag = wire.mac(wire.EVENT_DOMAIN, payload, self._secret)
            try:
                self._pub.send_multipart(
                    [cast(str, ev.__struct_config__.tag).encode(), payload, tag], zmq.NOBLOCK
                )
            except zmq.Again:  # a slow subscriber catches up with op "events"
                pass

    def _serve(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            reply = self._handle(body)
        except Exception:  # a bug costs this request, never the thread
            logger.exception("sessionkv: control request failed")
            reply = wire.refused(0, "internal error")
        try:
            payload = wire.request_encoder.encode(reply)
        except Exception:  # unencodable (a bug upstream)
            logger.exception("sessionkv: control reply not encodable")
            payload = self._encode_without_bad_events(reply)
        tag = wire.mac(wire.REPLY_DOMAIN, payload, self._secret)
        try:
            self._router.send_multipart([identity, payload, tag], zmq.NOBLOCK)
        except zmq.ZMQError:  # the client is gone or not reading
            pass

    def _encode_without_bad_events(self, reply: wire.ControlReply) -> bytes:
        """An events page without the events that cannot be encoded (its
        ``last_seq`` still past them, so readers go on), else a refusal."""
        good = []
        for ev in reply.events:
            try:
                encode_event(ev)
                good.append(ev)
            except Exception:
                pass
        try:
            return wire.request_encoder.encode(msgspec.structs.replace(reply, events=good))
        except Exception:
            return wire.request_encoder.encode(
                wire.refused(reply.counter, "internal error: reply not encodable")
            )

    def _handle(self, body: list[bytes]) -> wire.ControlReply:
        if len(body) != 2:
            return wire.refused(0, "malformed frame: expected [payload, mac]")
        payload, tag = body
        if len(payload) > wire.MAX_FRAME_BYTES:
            return wire.refused(0, f"oversized frame: more than {wire.MAX_FRAME_BYTES} bytes")
        if not wire.authentic(wire.REQUEST_DOMAIN, payload, tag, self._secret):
            return wire.refused(0, "unauthenticated: bad mac (wrong secret?)")
        try:
            req = wire.request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return wire.refused(0, f"malformed request: {e}")
        client = req.client
        bad = id_problem(client, "client")
        if bad:
            return wire.refused(req.counter, bad)
        why = self._guard.check(client, req.counter)
        if why:
            return wire.refused(req.counter, why)
        if not self._frames.take(client):
            return wire.refused(req.counter, "rate limit exceeded")
        return self._dispatch(req, client)

    def _dispatch(self, req: wire.ControlRequest, client: str) -> wire.ControlReply:
        """``_answer``, timed per op (``sessionkv:control_seconds``)."""
        t0 = time.perf_counter()
        try:
            return self._answer(req, client)
        finally:
            self._service.stats.control_work(
                req.op if req.op in wire.OPS else "other", time.perf_counter() - t0
            )

    def _answer(self, req: wire.ControlRequest, client: str) -> wire.ControlReply:
        reply = wire.ControlReply(counter=req.counter)
        if req.op != "hello" and self._engine_id and req.engine != self._engine_id:
            return wire.refused(req.counter, "frame for another engine (ask hello for its id)")
        bad = "" if req.session_id is None else id_problem(req.session_id, "session_id")
        if bad:
            return wire.refused(req.counter, bad)
        if req.op == "hello":
            reply.info = self.info
        elif req.op == "hints":
            items = [
                h if isinstance(h, HintOutcome) else msgspec.structs.replace(h, signed=True)
                for h in parse_envelope(req.hints, req.session_id)
            ]
            reply.outcomes = self._service.control_hints(items, req.session_id, f"control:{client}")
        elif req.op == "end_session":
            if req.session_id is None:
                return wire.refused(req.counter, "end_session needs session_id")
            live = self._service.end_session(req.session_id)
            outcome = HintOutcome(
                "end_session",
                "end_session",
                Status.ACCEPTED if live else Status.MISSING,
                reason="" if live else "unknown or already ended session",
            )
            self._service.emit_outcomes([outcome], Via.CONTROL, req.session_id, client)
            reply.outcomes = [outcome]
        elif req.op == "events":
            limit = max(0, min(req.limit, wire.MAX_EVENTS_PER_REPLY))
            reply.events, reply.oldest, reply.next_seq = self._events.since(req.after, limit)
            reply.last_seq = reply.events[-1].seq if reply.events else 0
        elif req.op == "status":
            reply.info = {
                **self._service.status(),
                "control": {"peers": dict(self.peers), "dropped_events": self.dropped_events},
            }
        elif req.op == "probe":
            if self._probe is None:
                return wire.refused(req.counter, "this engine cannot be probed")
            if not 0 < len(req.tokens) <= wire.MAX_PROBE_TOKENS:
                return wire.refused(req.counter, f"probe needs 1..{wire.MAX_PROBE_TOKENS} tokens")
            reply.info = self._probe(req.tokens)
        elif req.op == "resolve":
            if not 0 < len(req.block_hashes) <= MAX_KEYS:
                return wire.refused(req.counter, f"resolve needs 1..{MAX_KEYS} block_hashes")
            reply.keys = self._service.resolve_hashes(req.block_hashes)
        else:
            return wire.refused(
                req.counter, f"unknown op {req.op[:64]!r}; ops: {', '.join(wire.OPS)}"
            )
        return reply


def _bind(sock: zmq.Socket, host: str, port: int) -> str:
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"
