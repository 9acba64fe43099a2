"""G3 on Redis.

In ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "RedisTier", "module_path": "sessionkv.tiers.g3.backends.redis",
                         "url": "redis://127.0.0.1:6379/0", "ttl_s": 3600}]

Every batch is one pipelined round trip. Chunks are sent straight from the G2
region: commands are packed by redis-py's Python serializer, which keeps each
memoryview as its own piece for the socket (its hiredis serializer, the
default when ``hiredis`` is installed, runs ``bytes()`` on every value and
then packs the whole pipeline into one more copy). Replies are still parsed
by ``hiredis``. A load reads data and checksum objects in one pipeline and
copies the verified bytes straight into G2 (``owned_reads``); all of that
pipeline's replies are in memory at once.

Capacity: run Redis with ``maxmemory`` and ``maxmemory-policy volatile-lru``
(``scripts/services`` does). Under ``volatile-lru`` only keys with a TTL can
be evicted, so every object is written with ``ttl_s``. A full Redis refuses
writes (OOM): a failed store, never an error in the engine.

Pins. A Pin ``PERSIST``s its objects and records a lease in its namespace's
sorted set ``<namespace>/pin-leases`` (object name -> when its latest pin
ends, in the server's clock), both in one script; so an ACL user limited to
``<namespace>/*`` pins, and no engine touches another namespace's keys for
a lease someone wrote there. The TTL comes back when the pin lapses, only where no
other engine's pin on the object lasts longer; at a graceful shutdown for
the engine's pins still running; and after a crash from whichever engine
next starts on this server's namespace (every lease that ended, in batches
of ``SWEEP_BATCH``) or ends a pin (one batch). A Redis key made persistent by
a pin so never outlives its lease by more than the time until the next
engine start or pin lapse. A script the server refuses (an ACL without
scripting, a key it may not touch) fails the pin, not the tier. One server,
not Redis Cluster (the scripts touch several keys).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.logger import init_logger

from sessionkv.tiers.g3.tier import G3Tier, ObjectBackend

logger = init_logger(__name__)

# Abandoned calls (past the tier's deadline) still end: the socket times out.
SOCKET_TIMEOUT_S = 30.0
LEASES = "pin-leases"  # <namespace>/pin-leases: pinned object -> its pins' end (server time)
SWEEP_BATCH = 1000  # ended leases released per sweep call
MAX_SWEEPS = 1000  # calls of an engine start's sweep (a million leases)
# A lapse ends leases up to this much past the engine's own expiry: the
# server's lease began before the pin call returned, so it ends first.
LAPSE_SLACK_S = 1.0
BUFFER_CUTOFF = 6000  # redis-py's default: smaller arguments are joined into one piece

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "

# KEYS[1] the lease set, KEYS[2..] objects; ARGV[1] the pin's TTL. 1 per
# object that exists (now persistent, its lease at least now + TTL), else 0.
_PIN = (
    _NOW
    + """
local out = {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('PERSIST', KEYS[i])
    redis.call('ZADD', KEYS[1], 'GT', now + tonumber(ARGV[1]), KEYS[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# KEYS[1] the lease set, KEYS[2..] objects; ARGV[1] the objects' TTL,
# ARGV[i] how long KEYS[i]'s pin of this engine had left. Ends the pins whose
# lease ends by then (none longer), giving back the TTL.
_UNPIN = (
    _NOW
    + """
local ended = 0
for i = 2, #KEYS do
  local s = redis.call('ZSCORE', KEYS[1], KEYS[i])
  if (not s) or tonumber(s) <= now + tonumber(ARGV[i]) then
    redis.call('ZREM', KEYS[1], KEYS[i])
    if redis.call('TTL', KEYS[i]) == -1 then redis.call('EXPIRE', KEYS[i], ARGV[1]) end
    ended = ended + 1
  end
end
return ended
"""
)

# KEYS[1] the lease set; ARGV[1] the objects' TTL, ARGV[2] how many. Ends
# leases that ended (a crashed engine's); the number ended.
_SWEEP = (
    _NOW
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, n in ipairs(due) do
  redis.call('ZREM', KEYS[1], n)
  if redis.call('TTL', n) == -1 then redis.call('EXPIRE', n, ARGV[1]) end
end
return #due
"""
)


def _leases(name: str) -> str:
    """The lease set of the namespace of the object ``name`` (``ns/...``)."""
    return f"{name.split('/', 1)[0]}/{LEASES}"


def _driver_info(redis) -> dict:
    """The client's name and version for ``CLIENT SETINFO``, given once. Left
    to itself, redis-py (8.x) looks its version up in the installed package
    metadata for every new connection: a scan of every ``sys.path`` entry, on
    the call thread, inside the call's deadline. In an engine whose scheduler
    thread spins Python code (an idle engine stepping while lookups wait),
    that scan waits for the GIL at every ``stat``: seen taking more than 10 s
    (``exists timed out`` on a healthy server, thread stacks in
    ``importlib.metadata``), enough to trip the breaker."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py before 8: the older keyword
        return {"lib_version": redis.__version__}
    return {"driver_info": DriverInfo(lib_version=redis.__version__)}


class RedisBackend(ObjectBackend):
    """``ObjectBackend`` over a Redis server (one connection pool, thread-safe)."""

    owned_reads = True  # replies are new bytes objects: loads need no staging

    def __init__(
        self, url: str = "redis://127.0.0.1:6379/0", ttl_s: int = 3600, max_connections: int = 16
    ):
        import redis

        # types-redis 4.6's stubs, which mypy reads before redis 8's own
        # types, know neither the serializer nor ``command_packer``.
        from redis.connection import Encoder, PythonRespSerializer  # type: ignore[attr-defined]

        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0:
            raise ValueError(f"RedisTier: ttl_s must be a positive integer, got {ttl_s!r}")
        self._ttl = ttl_s
        # Stateless, so one packer serves every connection of the pool.
        packer = PythonRespSerializer(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
        self._redis = redis.Redis.from_url(  # type: ignore[call-overload]  # stubs: above
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            max_connections=max_connections,
            health_check_interval=0,
            command_packer=packer,
            **_driver_info(redis),
        )
        # One connection made now, at engine start and outside any deadline:
        # the first one's handshake ran 9-11 s inside an engine's first
        # guarded call (a call thread starved of the GIL while the scheduler
        # thread spins on a waiting request), past the tier's deadline. Best
        # effort: a server down now is the breaker's business later.
        self._pin = self._redis.register_script(_PIN)
        self._unpin = self._redis.register_script(_UNPIN)
        self._sweep = self._redis.register_script(_SWEEP)
        self._reachable = False
        try:
            self._reachable = bool(self._redis.ping())
        except Exception:
            pass

    def bind(self, namespace: str) -> None:
        """The tier's namespace is known: end every lease in it that ended
        (pins a crashed engine left), best effort; not when the server did
        not answer at start (its next pin lapse sweeps)."""
        if not self._reachable:
            return
        try:
            for _ in range(MAX_SWEEPS):
                if self.sweep(f"{namespace}/x") < SWEEP_BATCH:
                    return
        except Exception as e:  # down, or a key this user may not touch
            logger.warning("sessionkv: Redis lease sweep of %s failed: %r", namespace, e)

    @property
    def lapse_s(self) -> float:
        """How long an object we wrote lasts unpinned: its TTL (the tier's KV
        events report it removed then, ``tiers/g3/events.py``)."""
        return float(self._ttl)

    def register(self, buf: memoryview) -> None:
        return  # no registration: the client sends from the buffer

    def _pipeline(self, fill) -> list:
        pipe = self._redis.pipeline(transaction=False)
        fill(pipe)
        return pipe.execute(raise_on_error=False)

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        return [r == 1 for r in self._pipeline(lambda p: [p.exists(n) for n in names])]

    def put_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        return self.put_small(names, bufs)

    def get_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        if not names:
            return []
        sizes = []
        # GETRANGE to one byte past the buffer: a longer object is never read whole.
        got = self._pipeline(lambda p: [p.getrange(n, 0, len(b)) for n, b in zip(names, bufs)])
        for value, buf in zip(got, bufs):
            if not isinstance(value, bytes) or not value:
                sizes.append(-1)
                continue
            if len(value) == len(buf):
                buf[:] = value
            sizes.append(len(value))
        return sizes

    def put_small(self, names: Sequence[str], values: Sequence) -> list[bool]:
        if not names:
            return []
        res = self._pipeline(lambda p: [p.set(n, v, ex=self._ttl) for n, v in zip(names, values)])
        return [r is True for r in res]

    def get_small(self, names: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        if not names:
            return []
        if limit is None:
            got = self._pipeline(lambda p: [p.get(n) for n in names])
        else:  # one byte past the limit tells a longer object, unread
            got = self._pipeline(lambda p: [p.getrange(n, 0, limit) for n in names])
        return [
            v if isinstance(v, bytes) and v and (limit is None or len(v) <= limit) else None
            for v in got
        ]

    def remove(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        return [isinstance(r, int) for r in self._pipeline(lambda p: [p.delete(n) for n in names])]

    # Under volatile-lru only keys with a TTL are evicted: a pin removes it,
    # under a lease (the module docstring), and the tier ends it.
    pin_lapses = False

    def pin(self, names: Sequence[str], ttl_s: float, values: Sequence | None) -> list[bool]:
        # In parts: a script holds the server while it runs.
        import redis

        out = []
        for i in range(0, len(names), SWEEP_BATCH):
            part = list(names[i : i + SWEEP_BATCH])
            try:
                got = self._pin(keys=[_leases(part[0]), *part], args=[float(ttl_s)])
            except redis.exceptions.ResponseError as e:  # refused (an ACL): not pinned
                logger.warning("sessionkv: Redis refused a pin: %s", e)
                got = [0] * len(part)
            out += [r == 1 for r in got]
        return out

    def unpin(self, names: Sequence[str], left_s: Sequence[float]) -> None:
        for i in range(0, len(names), SWEEP_BATCH):
            left = [max(0.0, s) + LAPSE_SLACK_S for s in left_s[i : i + SWEEP_BATCH]]
            part = list(names[i : i + SWEEP_BATCH])
            self._unpin(keys=[_leases(part[0]), *part], args=[self._ttl, *left])
        if names:
            self.sweep(names[0])

    def sweep(self, name: str) -> int:
        """Give back the TTL of objects whose leases ended, in the namespace
        of the object ``name`` (at most ``SWEEP_BATCH``): how many."""
        return int(self._sweep(keys=[_leases(name)], args=[self._ttl, SWEEP_BATCH]))

    def close(self) -> None:
        self._redis.close()


class RedisTier(G3Tier):
    """G3 tier on Redis (see the module docstring). Tier config keys: ``url``,
    ``ttl_s``, ``max_connections``, and ``G3Tier``'s own."""

    backend_class = RedisBackend
