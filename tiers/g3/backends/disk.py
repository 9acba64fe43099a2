"""G3 on a local directory: the embedded G3, no service to start.

In the policy file's ``tiers.g3.tier`` (or ``secondary_tiers``)::

    - {type: DiskTier, path: /var/cache/sessionkv, max_bytes: 107374182400}

What vLLM 0.32 has (``FileSystemTierManager``, ``vllm/v1/kv_offload/tiering/fs``)
keeps no size limit, evicts nothing and checks no checksum, and is not a
``G3Tier``, which hints (the Mover's Demote, Prefetch, Share, Pin) need; this
is an ``ObjectBackend``, so the tier keeps every G3 rule: the fingerprint in
each name, the checksum or cluster MAC verified in the G2 slot before a load
counts, deadlines and the breaker.

Layout under ``path``::

    sessionkv-disk-tier       the mark: this directory is a DiskTier's
    objects/<h[:2]>/<h[2:]>   one object: the chunk's bytes then its 16-byte
                              seal (``inline_sums``); h = BLAKE2b-128 of its name
    tmp/<32 hex digits>       objects being written (linked into objects/ once whole),
                              and objects being removed (claimed out of objects/)
    usage                     16 bytes: the bytes under objects/, shared by every
                              engine; the longest pin TTL asked for (``pin``)
    usage.lock, evict.lock, count.lock    flock(2) locks

Trust boundary: the tier touches only this tree. ``path`` must be new, empty,
marked, or an unmarked tree of this layout (adopted); anything else is refused
at start, so ``path: /var`` never sweeps ``/var/tmp``. The tree belongs to the
engine's user and no one else (directories 0700, files 0600: the G2 region's
rule); a ``path`` owned by another user, or a part of the tree that is a
symbolic link or not of its kind, is refused at start. Every file is opened
with ``O_NOFOLLOW`` and checked to be a regular file (an object that is a
FIFO, device or link is a miss and is quarantined: removed from the tree,
never opened blocking); scans do not enter linked directories; the tmp/ sweep
removes only names of this layout's form.

Invariants. An object appears only whole (written in ``tmp/``, then
hard-linked into ``objects/``), so ``exists`` is one ``stat``. Objects
outlive the engine: a restarted engine, or another on the host with the same
identity, finds them. Nothing is fsynced: after a power loss a torn object
fails its seal (a miss). ``path`` must be on a filesystem with hard links.

``usage`` is exact: a put adds its bytes before its object appears; an
object leaves only by being *claimed* (renamed from ``objects/`` into
``tmp/``, which exactly one of several racing engines wins), and its
claimer subtracts the claimed file's size. A put over an existing object
claims that one first. So concurrent puts, removes and evictions, in any
process, keep the count equal to the bytes under ``objects/`` (a crash
between the two steps leaves it high by one object: a scan recounts).

Size limit, shared by every engine on the host that uses ``path``: a put
that would pass ``max_bytes`` fails (a failed store: the chunk stays in G2
or is recomputed). Past ``HIGH_WATER`` of ``max_bytes`` (or on a refused
put) a put wakes this backend's evictor thread, which, holding
``evict.lock`` (one evictor on the host at a time; the others skip), scans
the objects and claims the least recently used until ``LOW_WATER``; the scan
at start evicts only past ``HIGH_WATER``. A scan is O(objects) but runs on
its own thread, at start and once per ``HIGH_WATER - LOW_WATER`` of
``max_bytes`` written, never inside a call. A scan whose total differs from
``usage`` by more than ``RECOUNT_SLACK`` (a crash's leftovers; puts in
flight during the scan) recounts with puts and removes held on
``count.lock``. Engines that share ``path`` should give the same
``max_bytes``.

Recency and pins are the file's mtime: a read moves it to now, a Pin to the
pin's end when that is later (the longest pin holds, across engines), and
the evictor skips objects whose mtime is in the future, so a pin lapses by
itself (``pin_lapses``) and survives restarts. An mtime further ahead than
the longest pin TTL ever asked for on ``path`` (a duration, which a clock
step does not move) is no pin: the clock stepped back, and the evictor
counts the object as just used, so a stepped clock freezes eviction for at
most that TTL.

Threading: every call may run on several threads at once (each opens its own
files); ``usage`` updates take a process lock, then the flock; puts and
removes hold ``count.lock`` shared on a descriptor of their own.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from vllm.v1.kv_offload.base import Locality

from sessionkv.tiers.g3.backends.disk_tree import (
    _NOFOLLOW,
    FANOUT,
    MARK,  # noqa: F401  (re-exported: tests import it from here)
    _is_tmp_name,
    _open_tree,
    _regular_size,
    _unlink,
    _write_all,
)
from sessionkv.tiers.g3.tier import G3Tier, ObjectBackend

HIGH_WATER = 0.9  # of max_bytes: a put past it wakes the evictor
LOW_WATER = 0.8  # the evictor removes objects down to this
RECOUNT_SLACK = 0.01  # of max_bytes: a scan this far off the count recounts
STALE_TMP_S = 3600.0  # tmp/ files older than this are left by a crash: removed
PUT_TRIES = 8  # a put that lost this many races for its name fails
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")

logger = logging.getLogger(__name__)


class DiskBackend(ObjectBackend):
    """``ObjectBackend`` over a local directory (see the module docstring)."""

    inline_sums = True
    sum_objects = False  # objects appear whole (rename): lookups stat the object

    def __init__(
        self, path: str, max_bytes: int, on_evict: Callable[[set[str]], None] | None = None
    ):
        """``on_evict``: told the paths (``path_of``) of the objects each of
        this backend's evictions removed, on the evictor's thread."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"DiskTier: path must be a directory path, got {path!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"DiskTier: max_bytes must be a positive integer, got {max_bytes!r}")
        self.root = os.path.abspath(path)
        self.max_bytes = max_bytes
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        _open_tree(self.root)
        own = os.O_RDWR | os.O_CREAT | _NOFOLLOW
        self._usage = os.open(os.path.join(self.root, "usage"), own, 0o600)
        self._usage_lock = os.open(os.path.join(self.root, "usage.lock"), own, 0o600)
        self._evict_lock = os.open(os.path.join(self.root, "evict.lock"), own, 0o600)
        self._count_path = os.path.join(self.root, "count.lock")
        self._count_lock = os.open(self._count_path, own, 0o600)
        self.quarantined = 0  # objects that were no regular file: removed
        self._lock = threading.Lock()  # flock does not exclude this process's threads
        self.evictions = 0  # objects this backend's evictor removed
        self._on_evict = on_evict
        self._wake = threading.Event()
        self._refused = False  # a put was refused: evict even below HIGH_WATER
        self._closed = False
        self._evictor = threading.Thread(
            target=self._evict_loop, daemon=True, name="sessionkv-disk-evict"
        )
        self._evictor.start()
        self._wake.set()  # a first scan: counts what a crash left uncounted

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

    def pin_horizon(self) -> float:
        """The longest pin TTL asked for on ``path``, seconds (0 if none)."""
        raw = os.pread(self._usage, 8, 8)
        return max(0.0, _F64.unpack(raw)[0]) if len(raw) == 8 else 0.0

    def _raise_horizon(self, ttl_s: float) -> None:
        if ttl_s <= self.pin_horizon():
            return
        with self._lock:
            fcntl.flock(self._usage_lock, fcntl.LOCK_EX)
            try:
                if ttl_s > self.pin_horizon():
                    os.pwrite(self._usage, _F64.pack(ttl_s), 8)
            finally:
                fcntl.flock(self._usage_lock, fcntl.LOCK_UN)

    @contextmanager
    def _counting(self) -> Iterator[None]:
        """Hold ``count.lock`` shared (a recount waits): on a descriptor of
        this call's own, as one flock per descriptor is shared by threads."""
        fd = os.open(self._count_path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def _claim(self, path: str) -> bool | None:
        """Take the object at ``path`` out of ``objects/`` and subtract its
        size: True, None when it is not there, False on an error."""
        claimed = os.path.join(self._tmp, uuid.uuid4().hex)
        try:
            os.rename(path, claimed)  # a link is renamed, never followed
        except FileNotFoundError:
            return None
        except OSError:
            return False
        size = max(0, _regular_size(claimed))  # only regular files were counted
        _unlink(claimed)
        self._add_usage(-size)
        return True

    def _open_object(self, path: str) -> int | None:
        """A read descriptor on the object at ``path`` if it is a regular
        file; None if absent. An object that is a link, FIFO or device is
        quarantined (removed) and None: never a blocking open."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError:
            if os.path.islink(path):
                self._quarantine(path)
            return None
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        if not stat.S_ISDIR(mode):  # a directory cannot be claimed whole: a miss only
            self._quarantine(path)
        return None

    def _quarantine(self, path: str) -> None:
        if self._claim(path):
            self.quarantined += 1
            logger.warning("sessionkv: DiskTier removed %s: not a regular file", path)

    # ---- writes ------------------------------------------------------------------

    def _put(self, name: str, parts: Sequence) -> bool:
        size = sum(len(p) for p in parts)
        if not self._add_usage(size, self.max_bytes):
            self._refused = True
            self._wake.set()
            return False
        final, tmp = self.path_of(name), os.path.join(self._tmp, uuid.uuid4().hex)
        placed = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            try:
                _write_all(fd, parts, size)
            finally:
                os.close(fd)
            for _ in range(PUT_TRIES):
                try:
                    os.link(tmp, final)  # fails if the name is there: never replaces
                    placed = True
                    break
                except FileExistsError:
                    if self._claim(final) is False:
                        break
        except OSError:
            pass
        _unlink(tmp)
        if not placed:
            self._add_usage(-size)
            return False
        if self.usage() > HIGH_WATER * self.max_bytes:
            self._wake.set()
        return True

    def _put_all(self, names, parts) -> list[bool]:
        with self._counting():
            return [self._put(n, p) for n, p in zip(names, parts)]

    def put_summed(self, names, bufs, sums) -> list[bool]:
        return self._put_all(names, [(b, s) for b, s in zip(bufs, sums)])

    def put_chunks(self, names, bufs) -> list[bool]:
        return self._put_all(names, [(b,) for b in bufs])

    def put_small(self, names, values) -> list[bool]:
        return self._put_all(names, [(memoryview(v),) for v in values])

    def remove(self, names) -> list[bool]:
        with self._counting():
            return [self._claim(self.path_of(n)) is not False for n in names]

    # ---- reads -------------------------------------------------------------------

    def _read(self, name: str, parts: Sequence) -> int:
        """Object size read into ``parts`` (all of it when it fits them
        exactly), or -1. A read makes the object recent (unless pinned)."""
        fd = self._open_object(self.path_of(name))
        if fd is None:
            return -1
        try:
            st = os.fstat(fd)
            if (
                st.st_size == sum(len(p) for p in parts)
                and os.preadv(fd, list(parts), 0) != st.st_size
            ):
                return -1
            now = time.time()
            if st.st_mtime < now:
                try:
                    os.utime(fd, (now, now))
                except OSError:
                    pass  # recency is best effort (another user's object)
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

    def get_small(self, names, limit: int | None = None) -> list[bytes | None]:
        out: list[bytes | None] = []
        for n in names:
            fd = self._open_object(self.path_of(n))
            if fd is None:
                out.append(None)
                continue
            try:
                with os.fdopen(fd, "rb") as f:
                    if limit is not None and os.fstat(f.fileno()).st_size > limit:
                        out.append(None)
                        continue
                    out.append(f.read() or None)
            except OSError:
                out.append(None)
        return out

    def exists(self, names) -> list[bool]:
        return [_regular_size(self.path_of(n)) >= 0 for n in names]

    def register(self, buf: memoryview) -> None:
        return  # reads and writes go straight from and into the buffer

    # ---- pins --------------------------------------------------------------------

    pin_lapses = True  # a pin is a future mtime: it ends by itself

    def pin(self, names, ttl_s: float, values=None) -> list[bool]:
        until, out = time.time() + float(ttl_s), []
        self._raise_horizon(float(ttl_s))
        for n in names:
            path = self.path_of(n)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    out.append(False)
                    continue
                if st.st_mtime < until:
                    os.utime(path, (until, until), follow_symlinks=False)
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
            # Below HIGH_WATER a wake-up (the start scan) only recounts: a
            # directory left between the marks by a restart keeps its
            # objects, as a running engine's would (CI lost one that way).
            refused, self._refused = self._refused, False
            try:
                self.evict(start=LOW_WATER if refused else HIGH_WATER)
            except OSError:
                time.sleep(1.0)  # the directory went away or is unreadable: try later

    def evict(self, target: float = LOW_WATER, start: float | None = None) -> int:
        """When ``usage`` is above ``start`` (default ``target``) of
        ``max_bytes``, remove the least recently used unpinned objects until
        it is at most ``target``; the objects removed (0 if another engine's
        evictor holds the lock). Recounts first when the scan is off the
        count by more than ``RECOUNT_SLACK``."""
        try:
            fcntl.flock(self._evict_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        try:
            before = self.usage()
            now = time.time()
            entries, total = self._scan(now)
            after = self.usage()
            slack = RECOUNT_SLACK * self.max_bytes
            if not min(before, after) - slack <= total <= max(before, after) + slack:
                self._recount()
            self._sweep_tmp(now)
            removed: set[str] = set()
            if self.usage() > (target if start is None else start) * self.max_bytes:
                entries.sort()
                for _, path in entries:
                    if self.usage() <= target * self.max_bytes:
                        break
                    if self._claim(path):
                        removed.add(path)
            self.evictions += len(removed)
        finally:
            fcntl.flock(self._evict_lock, fcntl.LOCK_UN)
        if removed and self._on_evict is not None:
            self._on_evict(removed)
        return len(removed)

    def _scan(self, now: float) -> tuple[list[tuple[float, str]], int]:
        """(mtime, path) of the unpinned objects, and the bytes of all.
        Regular files only, in fan-out directories that are no links; an
        mtime past ``now`` plus the pin horizon is a stepped clock's: ``now``."""
        entries, total = [], 0
        ahead = now + self.pin_horizon()
        for i in range(FANOUT):
            fan = os.path.join(self._objects, f"{i:02x}")
            if not os.path.isdir(fan) or os.path.islink(fan):
                continue  # never made by this tier: not entered
            with os.scandir(fan) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    total += st.st_size
                    if st.st_mtime <= now:  # pinned objects stay
                        entries.append((st.st_mtime, e.path))
                    elif st.st_mtime > ahead:
                        entries.append((now, e.path))
        return entries, total

    def _recount(self) -> None:
        """Set ``usage`` to the bytes under ``objects/``, puts and removes
        held (the caller holds ``evict.lock``, so no eviction runs)."""
        fcntl.flock(self._count_lock, fcntl.LOCK_EX)
        try:
            _, total = self._scan(time.time())
            with self._lock:
                fcntl.flock(self._usage_lock, fcntl.LOCK_EX)
                try:
                    os.pwrite(self._usage, _U64.pack(total), 0)
                finally:
                    fcntl.flock(self._usage_lock, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._count_lock, fcntl.LOCK_UN)

    def _sweep_tmp(self, now: float) -> None:
        """Remove what a crash left in tmp/: names of this layout's form only."""
        with os.scandir(self._tmp) as it:
            for e in it:
                try:
                    if (
                        _is_tmp_name(e.name)
                        and not e.is_dir(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_mtime < now - STALE_TMP_S
                    ):
                        _unlink(e.path)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._evictor.join(timeout=5)
        for fd in (self._usage, self._usage_lock, self._evict_lock, self._count_lock):
            os.close(fd)


class DiskTier(G3Tier):
    """G3 tier on a local directory (see the module docstring). Tier config
    keys: ``path``, ``max_bytes``, and ``G3Tier``'s own."""

    backend_class = DiskBackend
    _backend: DiskBackend  # the only backend that calls ``_evicted``

    def __init__(self, *args, **kwargs):
        super().__init__(*args, on_evict=self._evicted, **kwargs)
        self.locality = Locality.LOCAL  # KV events: this host's storage

    def _evicted(self, paths: set[str]) -> None:
        """This backend's evictor removed ``paths``: the chunks announced in
        KV events among them are reported removed. On the evictor's thread:
        a name per announced chunk is hashed (``path_of``), as the scan that
        chose them read every object. Evictions by other engines' evictors
        on ``path`` are seen only by lookups here."""
        events = self.__dict__.get("_events")  # None until built, or without events
        if events is not None:
            path_of, name = self._backend.path_of, self.name
            events.gone([k for k in events.keys() if path_of(name(k)) in paths])
