"""G3 on a local directory: the embedded G3, no service to start.

In the policy file's ``tiers.g3`` (or ``secondary_tiers``)::

    - {type: DiskTier, path: /var/cache/sessionkv, max_bytes: 107374182400}

What vLLM 0.32 has (``FileSystemTierManager``, ``vllm/v1/kv_offload/tiering/fs``)
keeps no size limit, evicts nothing and checks no checksum, and is not a
``G3Tier``, which hints (the Mover's Demote, Prefetch, Share, Pin) need; this
is an ``ObjectBackend``, so the tier keeps every G3 rule: the fingerprint in
each name, the checksum or cluster MAC verified in the G2 slot before a load
counts, deadlines and the breaker.

Layout under ``path``::

    objects/<h[:2]>/<h[2:]>   one object: the chunk's bytes then its 16-byte
                              seal (``inline_sums``); h = BLAKE2b-128 of its name
    tmp/                      objects being written (renamed into objects/ once whole)
    usage                     8 bytes: the bytes under objects/, shared by every engine
    usage.lock, evict.lock    flock(2) locks

Invariants. An object appears only whole (written in ``tmp/``, then
``rename``d), so ``exists`` is one ``stat``. Objects outlive the engine: a
restarted engine, or another on the host with the same identity, finds them.
Nothing is fsynced: after a power loss a torn object fails its seal (a miss).

Size limit, shared by every engine on the host that uses ``path``: each put
adds its bytes to ``usage`` under ``usage.lock``; a put that would pass
``max_bytes`` fails (a failed store: the chunk stays in G2 or is
recomputed). Past ``HIGH_WATER`` of ``max_bytes`` a put wakes this
backend's evictor thread, which, holding ``evict.lock`` (one evictor on the
host at a time; the others skip), scans the objects and removes the least
recently used until ``LOW_WATER``, and resets ``usage`` to what it saw. A
scan is O(objects) but runs on its own thread, once per
``HIGH_WATER - LOW_WATER`` of ``max_bytes`` written, never inside a call.
Engines that share ``path`` should give the same ``max_bytes``.

Recency and pins are the file's mtime: a read moves it to now, a Pin to the
pin's end when that is later (the longest pin holds, across engines), and
the evictor skips objects whose mtime is in the future, so a pin lapses by
itself (``pin_lapses``) and survives restarts.

Threading: every call may run on several threads at once (each opens its own
files); ``usage`` updates take a process lock, then the flock.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
import time
import uuid
from collections.abc import Sequence

from vllm.v1.kv_offload.base import Locality

from .g3 import G3Tier, ObjectBackend

HIGH_WATER = 0.9        # of max_bytes: a put past it wakes the evictor
LOW_WATER = 0.8         # the evictor removes objects down to this
STALE_TMP_S = 3600.0    # tmp/ files older than this are left by a crash: removed
FANOUT = 256            # objects/<2 hex digits>/
_U64 = struct.Struct("<Q")


class DiskBackend(ObjectBackend):
    """``ObjectBackend`` over a local directory (see the module docstring)."""

    inline_sums = True
    sum_objects = False     # objects appear whole (rename): lookups stat the object

    def __init__(self, path: str, max_bytes: int):
        if not isinstance(path, str) or not path:
            raise ValueError(f"DiskTier: path must be a directory path, got {path!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"DiskTier: max_bytes must be a positive integer, got {max_bytes!r}")
        self.root = os.path.abspath(path)
        self.max_bytes = max_bytes
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        try:
            for i in range(FANOUT):
                os.makedirs(os.path.join(self._objects, f"{i:02x}"), exist_ok=True)
            os.makedirs(self._tmp, exist_ok=True)
            self._usage = os.open(os.path.join(self.root, "usage"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"DiskTier: cannot use path {path!r}: {e}") from e
        self._usage_lock = os.open(os.path.join(self.root, "usage.lock"),
                                   os.O_RDWR | os.O_CREAT, 0o644)
        self._evict_lock = os.open(os.path.join(self.root, "evict.lock"),
                                   os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()           # flock does not exclude this process's threads
        self.evictions = 0                      # objects this backend's evictor removed
        self._wake = threading.Event()
        self._closed = False
        self._evictor = threading.Thread(target=self._evict_loop, daemon=True,
                                         name="sessionkv-disk-evict")
        self._evictor.start()
        self._wake.set()            # a first scan: counts what a crash left uncounted

    # ---- names and usage -----------------------------------------------------

    def path_of(self, name: str) -> str:
        h = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
        return os.path.join(self._objects, h[:2], h[2:])

    def _add_usage(self, delta: int, limit: int | None = None) -> bool:
        """``usage += delta``; with ``limit``, only if the sum stays within it."""
        with self._lock:
            fcntl.flock(self._usage_lock, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._usage, 8, 0)
                now = _U64.unpack(raw)[0] if len(raw) == 8 else 0
                if limit is not None and now + delta > limit:
                    return False
                os.pwrite(self._usage, _U64.pack(max(0, now + delta)), 0)
                return True
            finally:
                fcntl.flock(self._usage_lock, fcntl.LOCK_UN)

    def usage(self) -> int:
        raw = os.pread(self._usage, 8, 0)
        return _U64.unpack(raw)[0] if len(raw) == 8 else 0

    # ---- writes ------------------------------------------------------------------

    def _put(self, name: str, parts: Sequence) -> bool:
        size = sum(len(p) for p in parts)
        if not self._add_usage(size, self.max_bytes):
            self._wake.set()
            return False
        final, tmp = self.path_of(name), os.path.join(self._tmp, uuid.uuid4().hex)
        try:
            old = _size_or_zero(final)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, parts, size)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError:
            _unlink(tmp)
            self._add_usage(-size)
            return False
        if old:
            self._add_usage(-old)                 # replaced: its bytes are free again
        if self.usage() > HIGH_WATER * self.max_bytes:
            self._wake.set()
        return True

    def put_summed(self, names, bufs, sums) -> list[bool]:
        return [self._put(n, (b, s)) for n, b, s in zip(names, bufs, sums)]

    def put_chunks(self, names, bufs) -> list[bool]:
        return [self._put(n, (b,)) for n, b in zip(names, bufs)]

    def put_small(self, names, values) -> list[bool]:
        return [self._put(n, (memoryview(v),)) for n, v in zip(names, values)]

    def remove(self, names) -> list[bool]:
        out = []
        for n in names:
            path = self.path_of(n)
            size = _size_or_zero(path)
            try:
                os.unlink(path)
                self._add_usage(-size)
                out.append(True)
            except FileNotFoundError:
                out.append(True)
            except OSError:
                out.append(False)
        return out

    # ---- reads -------------------------------------------------------------------

    def _read(self, name: str, parts: Sequence) -> int:
        """Object size read into ``parts`` (all of it when it fits them
        exactly), or -1. A read makes the object recent (unless pinned)."""
        try:
            fd = os.open(self.path_of(name), os.O_RDONLY)
        except OSError:
            return -1
        try:
            st = os.fstat(fd)
            if st.st_size == sum(len(p) for p in parts) and \
                    os.preadv(fd, list(parts), 0) != st.st_size:
                return -1
            now = time.time()
            if st.st_mtime < now:
                try:
                    os.utime(fd, (now, now))
                except OSError:
                    pass        # recency is best effort (another user's object)
            return st.st_size
        except OSError:
            return -1
        finally:
            os.close(fd)

    def get_summed(self, names, bufs, sums) -> list[int]:
        out = []
        for n, b, s in zip(names, bufs, sums):
            size = self._read(n, (b, s))
            out.append(-1 if size < 0 else max(0, size - len(s)))
        return out

    def get_chunks(self, names, bufs) -> list[int]:
        return [self._read(n, (b,)) for n, b in zip(names, bufs)]

    def get_small(self, names) -> list[bytes | None]:
        out = []
        for n in names:
            try:
                with open(self.path_of(n), "rb") as f:
                    out.append(f.read() or None)
            except OSError:
                out.append(None)
        return out

    def exists(self, names) -> list[bool]:
        return [os.path.exists(self.path_of(n)) for n in names]

    def register(self, buf: memoryview) -> None:
        return              # reads and writes go straight from and into the buffer

    # ---- pins --------------------------------------------------------------------

    pin_lapses = True       # a pin is a future mtime: it ends by itself

    def pin(self, names, ttl_s: float, values=None) -> list[bool]:
        until, out = time.time() + float(ttl_s), []
        for n in names:
            path = self.path_of(n)
            try:
                if os.stat(path).st_mtime < until:
                    os.utime(path, (until, until))
                out.append(True)
            except OSError:
                out.append(False)
        return out

    # ---- eviction ----------------------------------------------------------------

    def _evict_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.evict()
            except OSError:
                time.sleep(1.0)       # the directory went away or is unreadable: try later

    def evict(self, target: float = LOW_WATER) -> int:
        """Remove the least recently used unpinned objects until the directory
        holds at most ``target`` of ``max_bytes``; the objects removed (0 if
        another engine's evictor holds the lock). Resets ``usage`` to what the
        scan saw plus what was put meanwhile."""
        try:
            fcntl.flock(self._evict_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        try:
            counted_before = self.usage()
            now = time.time()
            entries, total = [], 0
            for i in range(FANOUT):
                with os.scandir(os.path.join(self._objects, f"{i:02x}")) as it:
                    for e in it:
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        total += st.st_size
                        if st.st_mtime <= now:              # pinned objects stay
                            entries.append((st.st_mtime, st.st_size, e.path))
            self._sweep_tmp(now)
            removed, freed = 0, 0
            if total > target * self.max_bytes:
                entries.sort()
                for _, size, path in entries:
                    if total - freed <= target * self.max_bytes:
                        break
                    if _unlink(path):
                        freed += size
                        removed += 1
            # puts and removes that ran during the scan moved usage since
            self._add_usage(total - freed - counted_before)
            self.evictions += removed
            return removed
        finally:
            fcntl.flock(self._evict_lock, fcntl.LOCK_UN)

    def _sweep_tmp(self, now: float) -> None:
        with os.scandir(self._tmp) as it:
            for e in it:
                try:
                    if e.stat().st_mtime < now - STALE_TMP_S:
                        _unlink(e.path)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._evictor.join(timeout=5)
        for fd in (self._usage, self._usage_lock, self._evict_lock):
            os.close(fd)


def _write_all(fd: int, parts: Sequence, size: int) -> None:
    """Every byte of ``parts`` (``size`` in all), through short writes."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(f"writev wrote {n} of {size} bytes")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _size_or_zero(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


class DiskTier(G3Tier):
    """G3 tier on a local directory (see the module docstring). Tier config
    keys: ``path``, ``max_bytes``, and ``G3Tier``'s own."""

    backend_class = DiskBackend

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.locality = Locality.LOCAL          # KV events: this host's storage
