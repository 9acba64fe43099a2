"""G3 in this process's memory: the reference backend.

It is the template for a new backend (``docs/guides/g3-backends.md``): the
``ObjectBackend`` contract and nothing else, each method a few lines, and
the contract suite (``tests/tiers/test_g3_contract.py``) runs on it with no
service. It is not shared between engines, so it is G3 only in name: use it
to test a stack, not to serve one.

Objects are bytes in an ``OrderedDict`` in least recently used order, at
most ``max_bytes`` in all: a put past it evicts the least recently used
objects not pinned, and fails when pinned ones alone fill it. Pins lapse by
themselves (``pin_lapses``). Checksums live in checksum objects
(``sum_objects``), read with their data in one call (``owned_reads``); puts
replace (``put_replaces``).

Threading: one lock around the dict; every call holds it for its batch.
Cost: O(bytes copied) per call; a put past ``max_bytes`` also walks the
least recently used objects up to the last it evicts (pinned ones included).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from sessionkv.tiers.g3.backend import ObjectBackend
from sessionkv.tiers.g3.tier import G3Tier


class MemoryBackend(ObjectBackend):
    """Named objects in a dict (see the module docstring)."""

    owned_reads = True  # get_small hands out the stored bytes: loads need no staging

    def __init__(self, max_bytes: int = 1 << 30):
        self._max_bytes = max_bytes
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._pinned: dict[str, float] = {}  # name -> monotonic time its pin ends
        self._lock = threading.Lock()

    def register(self, buf: memoryview) -> None:
        return  # plain copies: nothing to register

    def exists(self, names: Sequence[str]) -> list[bool]:
        with self._lock:
            return [n in self._objects for n in names]

    def put_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        return self.put_small(names, [bytes(b) for b in bufs])

    def get_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        out = []
        with self._lock:
            for name, buf in zip(names, bufs):
                data = self._touch(name)
                if data is None or len(data) > len(buf):
                    out.append(-1)
                    continue
                buf[: len(data)] = data
                out.append(len(data))
        return out

    def put_small(self, names: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        out = []
        with self._lock:
            for name, value in zip(names, values):
                self._drop(name)
                ok = self._make_room(len(value))
                if ok:
                    self._objects[name] = bytes(value)
                    self._bytes += len(value)
                out.append(ok)
        return out

    def get_small(self, names: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        with self._lock:
            got = [self._touch(n) for n in names]
        return [d if d and (limit is None or len(d) <= limit) else None for d in got]

    def remove(self, names: Sequence[str]) -> list[bool]:
        with self._lock:
            for name in names:
                self._drop(name)
        return [True] * len(names)

    def pin(
        self, names: Sequence[str], ttl_s: float, values: Sequence[memoryview] | None
    ) -> list[bool]:
        until = time.monotonic() + ttl_s
        with self._lock:
            out = [n in self._objects for n in names]
            for name, ok in zip(names, out):
                if ok:
                    self._pinned[name] = max(until, self._pinned.get(name, 0.0))
        return out

    def _touch(self, name: str) -> bytes | None:
        data = self._objects.get(name)
        if data is not None:
            self._objects.move_to_end(name)
        return data

    def _drop(self, name: str) -> None:
        data = self._objects.pop(name, None)
        if data is not None:
            self._bytes -= len(data)
        self._pinned.pop(name, None)

    def _make_room(self, size: int) -> bool:
        """Evict the least recently used objects not pinned until ``size``
        more bytes fit; whether they do."""
        now, need, going = time.monotonic(), self._bytes + size - self._max_bytes, []
        for name, data in self._objects.items():  # least recently used first
            if need <= 0:
                break
            if self._pinned.get(name, 0.0) <= now:
                going.append(name)
                need -= len(data)
        for name in going:
            self._drop(name)
        return self._bytes + size <= self._max_bytes


class MemoryTier(G3Tier):
    """G3 tier in this process's memory. Tier config keys: ``max_bytes``
    and ``G3Tier``'s own."""

    backend_class = MemoryBackend
