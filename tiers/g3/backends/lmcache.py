"""G3 on LMCache's storage server (``lm://``).

In ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "LMCacheTier", "module_path": "sessionkv.tiers.g3.backends.lmcache",
                         "url": "lm://127.0.0.1:65432"}]

The server is LMCache's own (``lmcache_server HOST PORT cpu``, which
``scripts/services`` runs); this client speaks its wire format
(``lmcache.v1.protocol`` of lmcache 0.5.6: fixed-size headers of 32-bit
fields and a 150-byte key). It does not import ``lmcache``: importing it
before vLLM's worker starts in the same process breaks vLLM's kernel
registration (it scans every module), and with multiprocessing off the worker
runs in the process that builds the tiers. The real server parsing every
header is the format's test (``tests/tiers/test_g3_contract.py``).

LMCache hashes its own token chunks, so this is storage for our keys, not
interoperability with LMCache's connector: each object name maps to one
``CacheEngineKey`` string (model ``sessionkv``, chunk hash = BLAKE2b-256 of
the name, so any name fits the key field).

Why our own client: LMCache's ``LMCServerConnector`` sends one request at a
time through an asyncio loop and needs an LMCache engine's allocator; here a
batch is one pipelined exchange per connection (all requests written, then
the replies read in order: the server answers a connection's requests in
order), chunks are sent straight from G2 and received straight into G2,
each followed by its checksum (``inline_sums``): a load reads no checksum
objects. A PUT has no reply: a batch of puts ends with a HEALTH request,
whose reply says the server has taken every put before it.

What the server lacks, and what we do instead: it has no delete (``remove``
overwrites with an empty object, and every read treats an empty object as
absent, so ``exists`` reads the object: the tier keeps a checksum object per
chunk, 16 bytes, for lookups and stores to ask about, ``sum_objects``); it
has no capacity limit or eviction (it keeps every object in one dict until
it exits), so size its host for the working set. LMCache's other
remote backends (``redis://``, ``mooncakestore://``) would put its asyncio
client in front of stores we already reach natively (``tiers/g3/backends/redis.py``,
``tiers/g3/backends/mooncake.py``); ``resp://`` deadlocked on ``destroy()`` when tried with LMCache 0.5.6.
"""

from __future__ import annotations

import hashlib
import queue
import socket
import struct
from collections.abc import Sequence
from urllib.parse import urlparse

from sessionkv.tiers.g3.tier import SUM_SUFFIX, G3Tier, ObjectBackend

# Abandoned calls (past the tier's deadline) still end: the socket times out.
SOCKET_TIMEOUT_S = 30.0
MODEL = "sessionkv"
QUICKACK = getattr(socket, "TCP_QUICKACK", 12)  # Linux

# lmcache.v1.protocol: ClientCommand, ServerReturnCode.SUCCESS, MemoryFormat.BINARY,
# DTYPE_TO_INT[torch.uint8], and the two header layouts.
PUT, GET, HEALTH = 1, 2, 5
SUCCESS = 200
BINARY, UINT8 = 4, 6
REQUEST = struct.Struct("iiiiiiiii150s")  # command length fmt dtype location shape*4 key
REPLY = struct.Struct("iiiiiiiii")  # code length fmt dtype shape*4 location


def parse_url(url: str) -> tuple[str, int]:
    """``lm://HOST:PORT`` -> (host, port), or ``ValueError``."""
    u = urlparse(url)
    if u.scheme != "lm" or not u.hostname or not u.port:
        raise ValueError(f"LMCacheTier: url must be lm://HOST:PORT, got {url!r}")
    return u.hostname, u.port


def header(command: int, name: str, length: int = 0) -> bytes:
    """A request header. The key is a ``CacheEngineKey`` string,
    ``model@world_size@worker_id@chunk_hash_hex@dtype``."""
    digest = hashlib.blake2b(name.encode(), digest_size=32).hexdigest()
    key = f"{MODEL}@1@0@{digest}@uint8".encode().ljust(150)  # space-padded, as LMCache does
    return REQUEST.pack(command, length, BINARY, UINT8, 0, length, 0, 0, 0, key)


def recv_some(sock: socket.socket, views: list[memoryview] | None = None, n: int = 0):
    """One read: into ``views`` (the count read), else up to ``n`` new bytes;
    ``ConnectionError`` when the server closed the connection."""
    # The server writes a reply's header and its bytes separately with
    # Nagle on: a delayed ACK from us would hold the bytes back 40 ms.
    # Linux leaves quick-ACK mode by itself, so set it around every read
    # (after it too: a segment may arrive while this thread waits for the
    # GIL, and a G3 tier has several threads).
    sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
    got = sock.recvmsg_into(views)[0] if views is not None else sock.recv(n)
    sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
    if not got:
        raise ConnectionError("lmcache server closed the connection")
    return got


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (filled or sent)."""
    while n:
        if n < len(views[0]):
            views[0] = views[0][n:]
            return
        n -= len(views.pop(0))


class Replies:
    """A connection's replies, in order: headers and small bodies read in
    bulk and split here (one read for many checksum objects), a body that
    fills the caller's buffers read straight into them past what is
    already here."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0

    def _have(self, n: int) -> None:
        while len(self._buf) - self._pos < n:
            self._buf += recv_some(self._sock, n=max(1 << 16, n))

    def take(self, n: int) -> bytes:
        self._have(n)
        self._pos += n
        return bytes(self._buf[self._pos - n : self._pos])

    def skip(self, n: int) -> None:
        """Read past the next ``n`` bytes, 64 KiB at a time (never held whole)."""
        here = min(n, len(self._buf) - self._pos)
        self._pos += here
        n -= here
        if self._pos == len(self._buf):
            self._buf, self._pos = bytearray(), 0
        scratch = memoryview(bytearray(1 << 16))
        while n:
            got = self._sock.recv_into(scratch, min(n, len(scratch)))
            if not got:
                raise ConnectionError("the server closed the connection mid-reply")
            n -= got

    def header(self) -> tuple[int, int]:
        """(code, length) of the next reply."""
        self._have(REPLY.size)
        code, length = REPLY.unpack_from(self._buf, self._pos)[:2]
        self._pos += REPLY.size
        return code, length

    def into(self, *views: memoryview) -> None:
        """Fill ``views``, in order, with the next bytes."""
        left = [v for v in views if len(v)]
        while left and self._pos < len(self._buf):  # what is here already
            n = min(len(left[0]), len(self._buf) - self._pos)
            left[0][:n] = self._buf[self._pos : self._pos + n]
            self._pos += n
            advance(left, n)
        if self._pos == len(self._buf):
            self._buf, self._pos = bytearray(), 0
        while left:
            advance(left, recv_some(self._sock, left))


def send_all(sock: socket.socket, *parts) -> None:
    """Write ``parts``, in order, gathered (the socket may take them piecemeal)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        advance(views, sock.sendmsg(views))


class LMCacheBackend(ObjectBackend):
    """``ObjectBackend`` over LMCache's ``lm://`` server; a pool of
    connections, one caller per connection at a time (thread-safe)."""

    def __init__(self, url: str = "lm://127.0.0.1:65432", max_connections: int = 8):
        self._addr = parse_url(url)
        # Idle connections; None stands for one not opened yet.
        self._idle: queue.LifoQueue = queue.LifoQueue()
        for _ in range(max_connections):
            self._idle.put(None)

    def _exchange(self, fn):
        """``fn(sock)`` on a pooled connection. Any error closes that
        connection (its stream position is unknown) and propagates."""
        sock = self._idle.get()
        try:
            if sock is None:
                sock = socket.create_connection(self._addr, timeout=SOCKET_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(SOCKET_TIMEOUT_S)
            result = fn(sock)
        except BaseException:
            if sock is not None:
                sock.close()
            self._idle.put(None)
            raise
        self._idle.put(sock)
        return result

    def _get(self, names: Sequence[str], into) -> list:
        """Pipelined GETs; ``into(i, replies, length)`` reads item i's bytes
        (-1: none) and returns its result."""

        def go(sock):
            sock.sendall(b"".join(header(GET, n) for n in names))
            replies, out = Replies(sock), []
            for i in range(len(names)):
                code, length = replies.header()
                out.append(into(i, replies, length if code == SUCCESS else -1))
            return out

        return self._exchange(go) if names else []

    def _put(self, names: Sequence[str], values: Sequence, sums: Sequence = ()) -> list[bool]:
        """Pipelined PUTs, then a HEALTH request: its reply says the server
        took every put. ``sums``: each value's checksum, after its bytes,
        and then each checksum object (the server stores in order)."""

        def go(sock):
            for n, v, s in zip(names, values, sums or [b""] * len(names)):
                send_all(sock, header(PUT, n, len(v) + len(s)), v, s)
            for n, s in zip(names, sums):
                send_all(sock, header(PUT, n + SUM_SUFFIX, len(s)), s)
            sock.sendall(header(HEALTH, MODEL))
            return Replies(sock).header()[0] == SUCCESS

        if not names:
            return []
        return [self._exchange(go)] * len(names)

    # ---- ObjectBackend ------------------------------------------------------------

    def register(self, buf: memoryview) -> None:
        return  # no registration: chunks go through the socket

    def exists(self, names: Sequence[str]) -> list[bool]:
        def there(i, r, length):
            if length > 0:
                r.skip(length)
            return length > 0

        return self._get(names, there)

    def put_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        return self._put(names, bufs)

    def get_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        return self._get(names, lambda i, r, length: self._read(r, length, bufs[i]))

    inline_sums = True

    def put_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[bool]:
        return self._put(names, bufs, sums)

    def get_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[int]:
        def into(i, r, length):
            size = self._read(r, length, bufs[i], sums[i])
            return size - len(sums[i]) if size >= len(sums[i]) else -1

        return self._get(names, into)

    @staticmethod
    def _read(replies: Replies, length: int, *views: memoryview) -> int:
        """One reply's bytes into ``views`` when they fill them exactly, else
        read past them; the object's size, or -1 (none, or empty: removed)."""
        if length == sum(len(v) for v in views):
            replies.into(*views)
        elif length > 0:  # the wrong size: read past, never held
            replies.skip(length)
        return length if length > 0 else -1

    def put_small(self, names: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        return self._put(names, values)

    def get_small(self, names: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        def small(i, r, length):
            if length > 0 and (limit is None or length <= limit):
                return r.take(length)
            if length > 0:
                r.skip(length)
            return None

        return self._get(names, small)

    def remove(self, names: Sequence[str]) -> list[bool]:
        return self._put(names, [b""] * len(names))

    def pin(self, names: Sequence[str], ttl_s: float, values: Sequence | None) -> list[bool]:
        """The server never evicts: what is there stays. Each object is
        answered by its chunk's checksum object (16 bytes, written after the
        data and removed before it), as lookups are: ``exists`` reads whole
        objects, and asking for the data objects brought every pinned
        chunk's bytes into the engine (``exists`` now reads past them)."""
        listed = [n if n.endswith(SUM_SUFFIX) else n + SUM_SUFFIX for n in names]
        asked = list(dict.fromkeys(listed))
        there = dict(zip(asked, self.exists(asked)))
        return [there[n] for n in listed]

    def close(self) -> None:
        while True:
            try:
                sock = self._idle.get_nowait()
            except queue.Empty:
                return
            if sock is not None:
                sock.close()


def health(url: str, timeout_s: float = 1.0) -> bool:
    """Whether an LMCache server answers a HEALTH request at ``url``."""
    try:
        with socket.create_connection(parse_url(url), timeout=timeout_s) as sock:
            sock.sendall(header(HEALTH, MODEL))
            return Replies(sock).header()[0] == SUCCESS
    except (OSError, struct.error, ValueError):
        return False


class LMCacheTier(G3Tier):
    """G3 tier on LMCache's ``lm://`` server (see the module docstring). Tier
    config keys: ``url``, ``max_connections``, and ``G3Tier``'s own."""

    backend_class = LMCacheBackend
