"""Clients of an engine's control channel: ``HintClient`` (blocking) and
``AsyncHintClient`` (asyncio), the same verbs on both.

    client = HintClient("tcp://127.0.0.1:5700", secret)
    client.pin("session-1", ttl_s=120)          # -> HintOutcome
    client.end_session("session-1")
    for event in client.subscribe(after=0):     # catch up, then follow
        ...

An endpoint comes from the engine's configuration (``sessionkv.control.port``)
or from the JSON file it writes (``sessionkv.control.endpoint_file``):
``HintClient.from_endpoint_file(path, secret)``.

Both sockets are CURVE clients with keys derived from the secret (an engine
with another secret refuses the handshake: both clients say so at once).
Every reply is authenticated; a reply that is not, or none within
``timeout_s``, raises ``ControlError``. Frames the engine refused come back as
one ``rejected`` outcome (``reply.error`` says why), not as exceptions.
Neither client is thread-safe: use one per thread (or per event loop).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from sessionkv import control as wire
from sessionkv.events import KINDS, AnyEvent, Outcome
from sessionkv.events import decode as decode_event
from sessionkv.hints import Action, HintOutcome, envelope, hint_action, id_problem


class ControlError(RuntimeError):
    """No authentic reply: the engine is unreachable, slow, or has another secret."""


_S = TypeVar("_S", bound=zmq.Socket)  # a blocking or an asyncio socket

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class EventPage(tuple):
    """``(events, oldest, next_seq, last_seq)`` from op ``events``; ``last_seq``
    the page's last event, skipped or not: where the next page starts."""

    @property
    def events(self) -> list[AnyEvent]:
        return self[0]

    @property
    def oldest(self) -> int:
        return self[1]

    @property
    def next_seq(self) -> int:
        return self[2]

    @property
    def last_seq(self) -> int:
        return self[3]


class _Protocol:
    """Framing shared by both clients, and the verbs (each returns what
    ``_one`` returns: a value for ``HintClient``, an awaitable for the other)."""

    _one: Callable[..., Any]  # each client's own

    def __init__(self, endpoint: str, secret: bytes, client_id: str | None, timeout_s: float):
        if not secret:
            raise ValueError("the control channel needs the engine's shared secret")
        self.endpoint = endpoint
        self._secret = secret
        self.client_id = (
            client_id or f"{os.uname().nodename[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        bad = id_problem(self.client_id, "client_id")
        if bad:
            raise ValueError(bad)
        self._timeout_ms = int(timeout_s * 1000)
        self._counter = 0
        self.skipped_events = 0  # events of kinds or fields this client does not know
        self.engine_id: str | None = None  # from the first hello: frames name their engine

    @classmethod
    def from_endpoint_file(cls, path: str, secret: bytes, **kwargs):
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f)["control"], secret, **kwargs)

    def _frames(self, op: str, **fields: Any) -> tuple[int, list[bytes]]:
        self._counter = max(self._counter + 1, time.time_ns())
        payload = wire.request_encoder.encode(
            wire.ControlRequest(
                client=self.client_id,
                counter=self._counter,
                op=op,
                engine="" if op == "hello" else self.engine_id or "",
                **fields,
            )
        )
        return self._counter, [payload, wire.mac(wire.REQUEST_DOMAIN, payload, self._secret)]

    def _reply(self, frames: list[bytes], counter: int | None) -> wire.ControlReply:
        """The authentic reply; to request ``counter`` unless it is None."""
        if len(frames) != 2 or not wire.authentic(
            wire.REPLY_DOMAIN, frames[0], frames[1], self._secret
        ):
            raise ControlError(f"{self.endpoint}: reply not authentic (another secret?)")
        try:
            reply, skipped = wire.decode_reply(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ControlError(
                f"{self.endpoint}: reply undecodable ({e}; a newer engine?)"
            ) from None
        self.skipped_events += skipped
        if counter is not None and reply.counter not in (counter, 0):
            raise ControlError(f"{self.endpoint}: reply to another request")
        return reply

    def _event(self, frames: list[bytes]) -> AnyEvent | None:
        if len(frames) == 3 and wire.authentic(
            wire.EVENT_DOMAIN, frames[1], frames[2], self._secret
        ):
            try:
                return decode_event(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.skipped_events += 1  # a kind or field unknown here (a newer engine)
        return None

    def _dealer(self, ctx: zmq.Context[_S]) -> tuple[_S, _S]:
        """The request socket, connected, and a monitor of its failed
        handshakes: an engine with another secret refuses the CURVE
        handshake, and the client says so at once rather than time out as if
        the engine were down."""
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        wire.secure_client(s, self._secret)
        monitor = s.get_monitor_socket(_HANDSHAKE_FAILED)
        s.connect(self.endpoint)
        return s, monitor

    def _subscriber(self, ctx: zmq.Context[_S], events_endpoint: str, kinds: Any) -> _S:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        wire.secure_client(sub, self._secret)
        for k in kinds or KINDS:
            sub.setsockopt(zmq.SUBSCRIBE, k.encode())
        sub.connect(events_endpoint)
        return sub

    # ---- verbs: one action each, the default target being the session ----------

    def pin(self, session_id: str, *, ttl_s: float | None = None, **target: Any):
        return self._one(Action.PIN, session_id, ttl_s=ttl_s, **target)

    def retain(self, session_id: str, *, priority: int, ttl_s: float | None = None, **target: Any):
        return self._one(Action.RETAIN, session_id, priority=priority, ttl_s=ttl_s, **target)

    def demote(self, session_id: str, **target: Any):
        return self._one(Action.DEMOTE, session_id, **target)

    def prefetch(self, session_id: str, **target: Any):
        return self._one(Action.PREFETCH, session_id, **target)

    def share(self, session_id: str, *, destination: str, **target: Any):
        return self._one(Action.SHARE, session_id, destination=destination, **target)


def _action(action: Action, session_id: str, kw: dict[str, Any]) -> dict[str, Any]:
    return hint_action(action, session_id=session_id, **kw)


class HintClient(_Protocol):
    """Blocking client (see the module docstring)."""

    def __init__(
        self, endpoint: str, secret: bytes, *, client_id: str | None = None, timeout_s: float = 5.0
    ):
        super().__init__(endpoint, secret, client_id, timeout_s)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock, self._monitor = self._dealer(self._ctx)
        return self._sock

    def call(self, op: str, **fields: Any) -> wire.ControlReply:
        """One request, its authentic reply (a hello first, to learn the engine's id)."""
        if op != "hello" and self.engine_id is None:
            self.hello()
        counter, frames = self._frames(op, **fields)
        sock = self._socket()
        monitor = self._monitor
        assert monitor is not None  # opened and closed with ``sock``
        sock.send_multipart(frames)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left)) if left > 0 else {}
            if sock in ready:
                return self._reply(sock.recv_multipart(), counter)
            if monitor in ready:
                recv_monitor_message(monitor)
                self.close()
                raise ControlError(
                    f"{self.endpoint}: handshake refused: not authentic (another secret?)"
                )
            if not ready:
                self.close()  # a late reply must not answer the next request
                raise ControlError(
                    f"{self.endpoint}: no reply within {self._timeout_ms} ms (engine down or busy)"
                )

    def hello(self) -> dict[str, Any]:
        info = self.call("hello").info
        self.engine_id = str(info.get("engine_id") or "")
        return info

    def hints(self, env: dict[str, Any], session_id: str | None = None) -> list[HintOutcome]:
        """Send an envelope (``sessionkv.hints.envelope``); one outcome per action."""
        return self.call("hints", hints=env, session_id=session_id).outcomes

    def _one(self, action: Action, session_id: str, **kw: Any) -> HintOutcome:
        return self.hints(envelope(_action(action, session_id, kw)), session_id)[0]

    def end_session(self, session_id: str) -> HintOutcome:
        return self.call("end_session", session_id=session_id).outcomes[0]

    def events(self, after: int = 0, limit: int = 1000) -> EventPage:
        r = self.call("events", after=after, limit=limit)
        if not r.ok:
            raise ControlError(f"{self.endpoint}: {r.error}")
        return EventPage((r.events, r.oldest, r.next_seq, r.last_seq))

    def resolve(self, block_hashes: list[int]) -> list[bytes]:
        """The chunk keys of the blocks (named by 64-bit hashes) the engine holds."""
        r = self.call("resolve", block_hashes=block_hashes)
        if not r.ok:
            raise ControlError(f"{self.endpoint}: {r.error}")
        return r.keys

    def status(self) -> dict[str, Any]:
        """Sessions, pins, outcome counts and recent evictions (op ``status``)."""
        r = self.call("status")
        if not r.ok:
            raise ControlError(f"{self.endpoint}: {r.error}")
        return r.info

    def probe(self, tokens: list[int]) -> dict[str, Any]:
        """How the engine hashes ``tokens`` and whether its G3 tiers answer
        (op ``probe``; ``sessionkv doctor``)."""
        r = self.call("probe", tokens=tokens)
        if not r.ok:
            raise ControlError(f"{self.endpoint}: {r.error}")
        return r.info

    def final_outcome(self, hint_id: str, after: int, timeout_s: float = 30.0) -> HintOutcome:
        """The final outcome of a ``deferred`` hint, read from the event log
        (events after ``after``: take ``events(0, 1).next_seq - 1`` before
        sending the hint); ``ControlError`` when none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            page = self.events(after)
            for ev in page.events:
                if (
                    isinstance(ev, Outcome)
                    and ev.via == "transfer"
                    and ev.outcome.hint_id == hint_id
                ):
                    return ev.outcome
            if page.events:
                after = page.events[-1].seq
            if time.monotonic() > deadline:
                raise ControlError(
                    f"{self.endpoint}: no final outcome for {hint_id} in {timeout_s:g} s"
                )
            time.sleep(0.05)

    def subscribe(
        self, after: int | None = None, kinds=None, idle_timeout_s: float | None = None
    ) -> Iterator[AnyEvent]:
        """Events in ``seq`` order: those kept after ``after`` first (None:
        only new ones), then the stream; an event lost on the way is fetched
        from the engine's log (while the engine keeps it). ``kinds`` filters
        on this side. Ends after ``idle_timeout_s`` without events (None: never)."""
        sub = self._subscriber(self._ctx, self.hello()["events"], None)
        wanted = set(kinds or KINDS)
        try:
            time.sleep(0.05)  # let the subscription reach the publisher
            last = self.events(1 << 62, 0).next_seq - 1 if after is None else after
            upto = None  # catch up to the end of the log
            timeout = None if idle_timeout_s is None else int(idle_timeout_s * 1000)
            while True:
                while upto is None or last < upto:
                    page = self.events(last, wire.MAX_EVENTS_PER_REPLY)
                    batch = [e for e in page.events if upto is None or e.seq <= upto]
                    if not batch:
                        break
                    for e in batch:
                        if e.__struct_config__.tag in wanted:
                            yield e
                        last = e.seq
                if not sub.poll(timeout):
                    return
                ev = self._event(sub.recv_multipart())
                if ev is None or ev.seq <= last:
                    continue
                upto = ev.seq  # fill (last, ev.seq] from the log if needed
                if ev.seq == last + 1:
                    last = ev.seq
                    if ev.__struct_config__.tag in wanted:
                        yield ev
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        if self._sock is not None:
            assert self._monitor is not None  # opened and closed with ``_sock``
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    def __enter__(self) -> HintClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncHintClient(_Protocol):
    """asyncio client: the same verbs as ``HintClient``, awaited. Requests may
    run concurrently on one client; replies are matched by counter."""

    def __init__(
        self, endpoint: str, secret: bytes, *, client_id: str | None = None, timeout_s: float = 5.0
    ):
        super().__init__(endpoint, secret, client_id, timeout_s)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._waiting: dict[int, Any] = {}
        self._reader: asyncio.Future[None] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._sending = asyncio.Lock()

    def _open(self) -> None:
        self._sock, self._monitor = self._dealer(self._ctx)
        self._watcher = asyncio.ensure_future(self._watch(self._monitor))

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A refused handshake fails the waiting calls at once, not at their
        timeout; the next call connects afresh."""
        await monitor.recv_multipart()
        err = ControlError(f"{self.endpoint}: handshake refused: not authentic (another secret?)")
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self._watcher = None  # close() must not cancel this task
        self.close()

    async def call(self, op: str, **fields: Any) -> wire.ControlReply:
        if op != "hello" and self.engine_id is None:
            await self.hello()
        if self._sock is None:
            self._open()
        # Frames leave in counter order (the engine refuses a counter below
        # one it has seen), even when concurrent calls wait to send.
        async with self._sending:
            counter, frames = self._frames(op, **fields)
            fut = asyncio.get_running_loop().create_future()
            self._waiting[counter] = fut
            if self._reader is None or self._reader.done():
                self._reader = asyncio.ensure_future(self._read())
            # Known race, kept as is: a refused handshake's close() while this
            # call waited for the lock leaves None here (AttributeError, not
            # ControlError).
            await self._sock.send_multipart(frames)  # type: ignore[union-attr]
        try:
            return await asyncio.wait_for(fut, self._timeout_ms / 1000)
        except asyncio.TimeoutError:
            raise ControlError(
                f"{self.endpoint}: no reply within {self._timeout_ms} ms (engine down or busy)"
            ) from None
        finally:
            self._waiting.pop(counter, None)

    async def _read(self) -> None:
        while self._waiting and self._sock is not None:
            frames = await self._sock.recv_multipart()
            try:
                reply = self._reply(frames, None)
            except ControlError as e:
                for fut in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(e)
                continue
            # Refused frames that could not be read come back with counter 0:
            # they answer the oldest request still waiting.
            key = (
                reply.counter
                if reply.counter in self._waiting
                else min(self._waiting, default=None)
            )
            fut = self._waiting.get(key) if key is not None else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def hello(self) -> dict[str, Any]:
        info = (await self.call("hello")).info
        self.engine_id = str(info.get("engine_id") or "")
        return info

    async def hints(self, env: dict[str, Any], session_id: str | None = None) -> list[HintOutcome]:
        return (await self.call("hints", hints=env, session_id=session_id)).outcomes

    async def _one(self, action: Action, session_id: str, **kw: Any) -> HintOutcome:
        return (await self.hints(envelope(_action(action, session_id, kw)), session_id))[0]

    async def end_session(self, session_id: str) -> HintOutcome:
        return (await self.call("end_session", session_id=session_id)).outcomes[0]

    async def events(self, after: int = 0, limit: int = 1000) -> EventPage:
        r = await self.call("events", after=after, limit=limit)
        if not r.ok:
            raise ControlError(f"{self.endpoint}: {r.error}")
        return EventPage((r.events, r.oldest, r.next_seq, r.last_seq))

    async def stream(self, kinds=None) -> AsyncIterator[AnyEvent]:
        """New events as they are published (no catch-up: use ``events``)."""
        sub = self._subscriber(self._ctx, (await self.hello())["events"], kinds)
        try:
            while True:
                ev = self._event(await sub.recv_multipart())
                if ev is not None:
                    yield ev
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._reader = self._watcher = None
        if self._sock is not None:
            assert self._monitor is not None  # opened and closed with ``_sock``
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None
