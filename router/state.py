"""Session state in Redis, shared by every router replica.

Per session, one hash ``{namespace}:s:{session_id}``: ``owner`` (the client
that named it first, ``bind``: a session id is that client's alone),
``worker`` (where its turns go), ``turns``, ``created``, ``last_ts`` (when its last turn ended or
began), ``gap_until`` (a tool gap's expected end, 0 when none). A sorted set
``{namespace}:active`` orders live sessions by ``last_ts`` for the idle sweep.
Placement is claimed with ``HSETNX`` and moves are compare-and-set, so
replicas that race agree on one worker; ending is claimed by removing the
session from the active set, so exactly one replica acts on an end.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis

from sessionkv.router.config import RedisConfig

log = logging.getLogger("sessionkv.router")

# KEYS[1] the session hash, ARGV: expected worker, new worker. 1 when moved.
_MOVE = """
if redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'worker', ARGV[2])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class SessionState:
    session_id: str
    worker: str
    turns: int
    created: float
    last_ts: float
    gap_until: float


def redact(url: str) -> str:
    """``url`` without its password (``redis://user:***@host``), for logs."""
    head, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{head}{sep}{creds.split(':', 1)[0]}:***@{host}"


class StateError(RuntimeError):
    """Redis did not answer."""


class SessionStore:
    """Async access to the session records (see the module docstring)."""

    def __init__(self, cfg: RedisConfig):
        self._cfg = cfg
        self._redis = aioredis.Redis.from_url(
            cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s
        )
        self._ns = cfg.namespace
        self._move = self._redis.register_script(_MOVE)

    def _key(self, session_id: str) -> str:
        return f"{self._ns}:s:{session_id}"

    @property
    def _active(self) -> str:
        return f"{self._ns}:active"

    async def get(self, session_id: str) -> SessionState | None:
        raw = await self._redis.hgetall(self._key(session_id))
        if not raw or b"worker" not in raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return SessionState(
            session_id,
            f["worker"],
            int(f.get("turns", 0)),
            float(f.get("created", 0)),
            float(f.get("last_ts", 0)),
            float(f.get("gap_until", 0)),
        )

    async def bind(self, session_id: str, owner: str) -> str:
        """The session's owner: ``owner`` unless another client named it first."""
        key = self._key(session_id)
        async with self._redis.pipeline(transaction=True) as p:
            p.hsetnx(key, "owner", owner)
            p.hget(key, "owner")
            p.expire(key, int(self._cfg.state_ttl_s))
            _, bound, _ = await p.execute()
        return bound.decode()

    async def owner(self, session_id: str) -> str | None:
        """Who the session is bound to; None when it is unknown."""
        raw = await self._redis.hget(self._key(session_id), "owner")
        return None if raw is None else raw.decode()

    async def claim(self, session_id: str, worker: str) -> str:
        """Place a new session on ``worker`` unless a replica placed it first;
        the worker it is on."""
        key, now = self._key(session_id), time.time()
        async with self._redis.pipeline(transaction=True) as p:
            p.hsetnx(key, "worker", worker)
            p.hsetnx(key, "created", now)
            p.hget(key, "worker")
            _, _, placed = await p.execute()
        await self._refresh(session_id, now)
        return placed.decode()

    async def move(self, session_id: str, old: str, new: str) -> bool:
        """Move a session from ``old`` to ``new``; False when another replica
        moved it first."""
        return bool(await self._move(keys=[self._key(session_id)], args=[old, new]))

    async def turn_started(self, session_id: str) -> None:
        key, now = self._key(session_id), time.time()
        async with self._redis.pipeline(transaction=True) as p:
            p.hincrby(key, "turns", 1)
            p.hset(key, mapping={"last_ts": now, "gap_until": 0})
            await p.execute()
        await self._refresh(session_id, now)

    async def turn_ended(self, session_id: str, gap_s: float | None) -> None:
        """A turn finished; ``gap_s``: it ended in a tool call expected to last this long."""
        now = time.time()
        gap_until = now + gap_s if gap_s else 0
        await self._redis.hset(
            self._key(session_id), mapping={"last_ts": now, "gap_until": gap_until}
        )
        await self._refresh(session_id, max(now, gap_until))  # idle counts from the gap's end

    async def _refresh(self, session_id: str, score: float) -> None:
        async with self._redis.pipeline(transaction=False) as p:
            p.zadd(self._active, {session_id: score})
            p.expire(self._key(session_id), int(self._cfg.state_ttl_s))
            await p.execute()

    async def end(self, session_id: str) -> SessionState | None:
        """Claim a session's end: its last state when this caller won, else None
        (unknown, or another replica ended it)."""
        state = await self.get(session_id)
        if not await self._redis.zrem(self._active, session_id):
            return None
        await self._redis.delete(self._key(session_id))
        return state

    async def idle(self, idle_s: float) -> list[str]:
        """Sessions idle for ``idle_s`` after their last turn (or its tool gap's
        expected end), still to be claimed."""
        raw = await self._redis.zrangebyscore(self._active, 0, time.time() - idle_s)
        return [s.decode() for s in raw]

    async def round_robin(self) -> int:
        """A counter shared by replicas, to break ties between equal workers."""
        return int(await self._redis.incr(f"{self._ns}:rr"))

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except Exception as e:
            raise StateError(f"redis {redact(self._cfg.url)}: {e}") from e

    async def close(self) -> None:
        await self._redis.aclose()  # type: ignore[attr-defined]  # redis>=5 has it; types-redis predates it


class ResilientStore:
    """``SessionStore`` for a router that keeps routing while Redis does not
    answer: every call that fails falls back to this replica's own memory
    (the placements it made or read lately, at most ``max_sessions``, least
    recently used first out) and is counted; nothing raises. Without Redis a
    session sticks to the worker this replica last sent it to, placements of
    other replicas are not seen, and idle sessions are not ended (the sweep
    reads Redis) until it answers again. A call that fails (refused, or past
    ``redis.timeout_s``: a stopped or partitioned server) sends every call of
    the next ``redis.retry_s`` to memory at once, so a turn waits for at most
    one timeout.

    Threading: the router's event loop only."""

    def __init__(
        self, store: SessionStore, max_sessions: int, retry_s: float = 5.0, clock=time.monotonic
    ):
        self._store = store
        self._retry_s = retry_s
        self._clock = clock
        self._down_until = float("-inf")
        self._max = max_sessions
        self._local: OrderedDict[str, SessionState] = OrderedDict()
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._rr = 0
        self.errors = 0
        self.last_error = ""

    def status(self) -> dict:
        return {
            "errors": self.errors,
            "last_error": self.last_error,
            "local_sessions": len(self._local),
            "usable": self.usable(),
        }

    def usable(self) -> bool:
        """False while calls go to memory after a failure (``retry_s``)."""
        return self._clock() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        self.errors += 1
        self._down_until = self._clock() + self._retry_s
        if not self.last_error:
            log.warning(
                "session state: %s failed (%r): routing from this replica's memory", what, e
            )
        self.last_error = f"{what}: {e!r}"[:200]

    def _remember(self, state: SessionState | None) -> SessionState | None:
        if state is not None:
            self._local[state.session_id] = state
            self._local.move_to_end(state.session_id)
            while len(self._local) > self._max:
                self._local.popitem(last=False)
        return state

    def _placed(self, session_id: str, worker: str) -> None:
        old = self._local.get(session_id)
        now = time.time()
        self._remember(
            SessionState(
                session_id, worker, old.turns if old else 0, old.created if old else now, now, 0.0
            )
        )

    async def _try(self, what: str, call, fallback):
        """``await call``, or ``fallback`` (counted) when Redis fails or
        failed within ``retry_s``."""
        if not self.usable():
            call.close()  # never awaited: no call reaches Redis
            self.errors += 1
            return fallback
        try:
            return await call
        except Exception as e:
            self._failed(what, e)
            return fallback

    async def get(self, session_id: str) -> SessionState | None:
        marker = object()
        state = await self._try("get", self._store.get(session_id), marker)
        if state is marker:
            return self._local.get(session_id)
        self.last_error = ""
        return self._remember(state)

    async def bind(self, session_id: str, owner: str) -> str:
        """The session's owner. An owner this replica remembers is the one
        bound: a Redis that lost the record (a restart without persistence)
        gets it back, and the next turn's key does not take the session."""
        claim = self._owners.get(session_id, owner)
        bound = await self._try("bind", self._store.bind(session_id, claim), claim)
        self._owners[session_id] = bound
        self._owners.move_to_end(session_id)
        while len(self._owners) > self._max:
            self._owners.popitem(last=False)
        return bound

    async def owner(self, session_id: str) -> str | None:
        return await self._try("owner", self._store.owner(session_id), self._owners.get(session_id))

    async def claim(self, session_id: str, worker: str) -> str:
        placed = await self._try("claim", self._store.claim(session_id, worker), worker)
        self._placed(session_id, placed)
        return placed

    async def move(self, session_id: str, old: str, new: str) -> bool:
        moved = await self._try("move", self._store.move(session_id, old, new), True)
        if moved:
            self._placed(session_id, new)
        return moved

    async def turn_started(self, session_id: str) -> None:
        await self._try("turn_started", self._store.turn_started(session_id), None)

    async def turn_ended(self, session_id: str, gap_s: float | None) -> None:
        # The turn is done: a failure here is never an error for the client.
        await self._try("turn_ended", self._store.turn_ended(session_id, gap_s), None)

    async def end(self, session_id: str) -> SessionState | None:
        local = self._local.pop(session_id, None)
        self._owners.pop(session_id, None)
        return await self._try("end", self._store.end(session_id), local)

    async def idle(self, idle_s: float) -> list[str]:
        return await self._try("idle", self._store.idle(idle_s), [])

    async def round_robin(self) -> int:
        rr = await self._try("round_robin", self._store.round_robin(), None)
        if rr is None:
            self._rr += 1
            return self._rr
        return rr

    async def ping(self) -> None:
        await self._store.ping()

    async def close(self) -> None:
        await self._store.close()
