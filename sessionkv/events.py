"""The engine's event stream: what happened to sessions, blocks and hints.

Every event carries ``seq``, a number that grows by one per event of an
engine (per DP rank), and ``ts`` (``time.time()``). Kinds:

- ``association``: a session's branch grew (``Op.EXTEND``: ``blocks`` is the
  chain's length, ``frontier`` its deepest key, ``tier`` where the new blocks
  are) or the session ended (``Op.END``, ``reason`` ``"hint"`` or ``"idle"``);
- ``residency``: chunks became resident in a tier (``present=True``) or a
  store into it failed (``present=False``);
- ``eviction``: chunks a tier evicted to make room (or dropped on reset);
- ``transfer``: a copy between tiers finished (``src`` -> ``dst``, ``ok``);
- ``outcome``: a hint's outcome (``via``: ``Via.REQUEST``, ``CONTROL``,
  ``POLICY`` (a pin clipped later under pressure) or ``TRANSFER`` (a deferred
  hint's final outcome)).

Tiers are named as ``Tier``'s names (``TierName``); ``Op`` and ``Via`` are
string enums, so the wire carries the same strings as the values.

Chunk keys are vLLM ``OffloadKey`` bytes (a chunk is keyed by its last block).
G1 evictions are not reported here: vLLM reports no G1 evictions to
connectors; its own KV cache events cover G1.

``EventLog`` numbers events and keeps the newest ``capacity`` of them, so that
a subscriber that joined late, or lost messages, asks for everything after the
last ``seq`` it saw (``since``). Thread-safe: the scheduler thread and the
control channel's thread both append.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from enum import Enum
from typing import Literal

import msgspec

from sessionkv.hints import HintOutcome
from sessionkv.types import TierName

DEFAULT_CAPACITY = 65_536


class Op(str, Enum):
    """What happened to a session (``Association``)."""

    EXTEND = "extend"
    END = "end"


class Via(str, Enum):
    """How an outcome was made (``Outcome``)."""

    REQUEST = "request"  # a request's hints, when it finished
    CONTROL = "control"  # the control channel
    POLICY = "policy"  # a pin clipped later under pressure
    TRANSFER = "transfer"  # a deferred hint's final outcome


class Event(msgspec.Struct, tag_field="kind", kw_only=True):
    seq: int = 0
    ts: float = 0.0


class Association(Event, tag="association"):
    session_id: str
    op: Op
    tier: TierName | None = None
    blocks: int = 0
    frontier: bytes | None = None
    reason: Literal["", "hint", "idle"] = ""


class Residency(Event, tag="residency"):
    tier: TierName
    keys: list[bytes]
    present: bool = True


class Eviction(Event, tag="eviction"):
    tier: TierName
    keys: list[bytes]
    reason: Literal["capacity", "reset"] = "capacity"


class Transfer(Event, tag="transfer"):
    src: TierName
    dst: TierName
    keys: list[bytes]  # chunks copied
    ok: bool = True
    req_id: str | None = None
    hint_id: str | None = None  # the Demote, Prefetch or Share that made the copy
    already: list[bytes] = []  # a hint's chunks found at dst already (not copied)


class Outcome(Event, tag="outcome"):
    outcome: HintOutcome
    via: Via
    session_id: str | None = None
    client: str | None = None


AnyEvent = Association | Residency | Eviction | Transfer | Outcome
KINDS = ("association", "residency", "eviction", "transfer", "outcome")


class Wake:
    """A pipe that wakes a reader sleeping in ``poll``: ``set`` by any thread
    (nonblocking; a full pipe already wakes it), ``drain``ed by the reader
    before it works. The event log's publisher and the engine's hint work
    (``SessionTierManager.wake``: copies ended, a hold left work) use one each."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        """Readable once set, until drained."""
        return self._r

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class EventLog:
    """Numbered events, the newest ``capacity`` kept (see the module docstring).

    ``wake_fd`` (a pipe's read end) becomes readable when events were appended
    since the last ``drain_new``: one byte per batch, not per event, so the
    publisher's thread sleeps in ``poll`` until there is work."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._lock = threading.Lock()
        self._events: deque[AnyEvent] = deque(maxlen=capacity)
        self._next_seq = 1
        self._published = 0  # highest seq handed to drain_new
        self._signalled = False
        self._wake = Wake()

    @property
    def wake_fd(self) -> int:
        return self._wake.fd

    def append(self, event: AnyEvent) -> int:
        """Number and keep one event; its ``seq``."""
        with self._lock:
            event.seq = self._next_seq
            event.ts = time.time()
            self._next_seq += 1
            self._events.append(event)
            if not self._signalled:
                self._signalled = True
                self._wake.set()
            return event.seq

    def drain_new(self) -> list[AnyEvent]:
        """Events appended since the last call (for the publisher)."""
        with self._lock:
            self._wake.drain()
            self._signalled = False
            new = self._tail(self._published, None)
            if new:
                self._published = new[-1].seq
            return new

    def since(self, after: int, limit: int) -> tuple[list[AnyEvent], int, int]:
        """Up to ``limit`` events with ``seq > after``, oldest first, plus the
        oldest seq still kept and the next seq to be assigned. A gap (``after
        + 1 <`` oldest) means events were dropped before the caller asked."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._next_seq
            return self._tail(after, limit), oldest, self._next_seq

    def _tail(self, after: int, limit: int | None) -> list[AnyEvent]:
        ev = self._events
        if not ev or after >= ev[-1].seq:
            return []
        start = max(0, after + 1 - ev[0].seq)
        if len(ev) - start <= 64:  # the publisher's case: deque indexing near the end is O(1)
            return [ev[i] for i in range(start, len(ev))][:limit]
        stop = None if limit is None else start + limit
        return list(itertools.islice(ev, start, stop))

    def close(self) -> None:
        self._wake.close()


encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(AnyEvent).decode
