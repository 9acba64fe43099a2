"""The G3 object contract (``ObjectBackend``) and the checksum every G3 tier
keeps with each chunk: in a checksum object next to the chunk's
(``sum_objects``), in the chunk's own object (``inline_sums``), or both. See ``tiers/g3/tier.py`` for how the tier
uses them; ``tiers/g3/backends/mooncake.py``, ``redis.py`` and ``lmcache.py`` implement it.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import blake3
import xxhash

SUM = struct.Struct("<QQ")  # xxh3-64 of the chunk, its length
SUM_SUFFIX = ".sum"


def checksum(data) -> bytes:
    """The checksum object of one chunk's bytes."""
    return SUM.pack(xxhash.xxh3_64_intdigest(data), len(data))


class Seal:
    """The ``SUM.size`` bytes kept with a chunk's bytes, checked before a
    load counts. Without a key: ``checksum`` (xxh3-64 and the length), which
    catches torn and corrupted objects but not a writer who recomputes it.
    With a key (``sessionkv.keys.derive(secret, G3_MAC)``): keyed BLAKE3
    over the object's name and bytes, so only holders of the key make
    objects that verify, and an object copied under another name does not."""

    def __init__(self, key: bytes | None = None):
        if key is not None and len(key) != 32:
            raise ValueError("a G3 MAC key is 32 bytes")
        self.key = key

    @property
    def id(self) -> str:
        """Which seal, for the fingerprint: engines sealing with other keys
        (or none) name other objects, so none unlists another's objects as
        failing. Names the key without revealing it."""
        if self.key is None:
            return "xxh3"
        return (
            "mac:"
            + hashlib.blake2b(b"sessionkv g3 key id", key=self.key, digest_size=8).hexdigest()
        )

    def __call__(self, name: str, data) -> bytes:
        if self.key is None:
            return checksum(data)
        h = blake3.blake3(key=self.key)
        raw = name.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
        h.update(data)
        return h.digest(length=SUM.size)


def address_of(view: memoryview) -> int:
    """The address of a writable, contiguous buffer (for zero-copy backends)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class ObjectBackend(ABC):
    """Named whole objects in a shared store, copied from and into host buffers.

    ``register`` comes first for every buffer the tier copies from or into
    (zero-copy backends pin or register it). Every batch call returns one
    result per item, in order, and does not raise for one item's failure
    (``False`` / ``None``); raising means the backend as a whole failed.
    Calls may hang: the tier runs them on its own threads with deadlines, and
    may call them from several threads at once.
    """

    #: Each chunk's checksum travels in the chunk's own object: the chunk's
    #: bytes, then ``SUM.size`` bytes of checksum, written and read in the same
    #: call (scatter/gather: ``put_summed``, ``get_summed``). Loads read
    #: straight into G2 slots and verify them there; the slots are held in
    #: quarantine while a call past its deadline may still write them. A
    #: ``put_summed`` of a name that exists keeps one whole object, the old
    #: one (Mooncake) or the new (LMCache), so vLLM's cascades put without
    #: asking first.
    inline_sums: ClassVar[bool] = False

    #: A put of a name that exists writes the new object (Redis, LMCache,
    #: the disk). Mooncake keeps the old one and answers success alike, so
    #: the tier asks before its puts and removes what it must replace.
    put_replaces: ClassVar[bool] = True

    #: Each chunk also has a checksum object (``name + SUM_SUFFIX``), written
    #: after its data object: what lookups and stores ask for. Without it
    #: (only with ``inline_sums``), they ask for the data object, which the
    #: backend must make visible only once whole and must answer cheaply.
    sum_objects: ClassVar[bool] = True

    def put_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[bool]:
        """Store each buffer followed by its checksum as the named object
        (``inline_sums``); ``sums`` lie in a registered buffer. With
        ``sum_objects``, also each checksum as its checksum object, after
        its data object (one exchange where the backend can)."""
        raise NotImplementedError

    def get_summed(
        self, names: Sequence[str], bufs: Sequence[memoryview], sums: Sequence[memoryview]
    ) -> list[int]:
        """Read each named object into ``bufs[i]`` and, after it, ``sums[i]``
        (``inline_sums``): per item the object's size less ``len(sums[i])``
        (equal to ``len(bufs[i])`` when the whole object arrived), or -1."""
        raise NotImplementedError

    #: ``get_small`` returns buffers of the backend's own for objects of any
    #: size: loads then read data and checksum objects in one call and copy
    #: verified bytes straight into G2, without staging.
    owned_reads: ClassVar[bool] = False

    @abstractmethod
    def register(self, buf: memoryview) -> None: ...

    def bind(self, namespace: str) -> None:  # noqa: B027 (optional: most keep nothing)
        """The tier's namespace (every name it uses starts ``namespace/``),
        told once at start: a backend may tidy what it keeps per namespace."""

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[bool]:
        """Store each buffer as the named object (zero-copy where the backend
        can). An existing object of that name is replaced, or, where the
        backend does not ``put_replaces``, may be kept (True either way)."""

    @abstractmethod
    def get_chunks(self, names: Sequence[str], bufs: Sequence[memoryview]) -> list[int]:
        """Copy each named object into its buffer: per item the object's size
        when it was read (equal to ``len(buf)`` when the whole object
        arrived), or -1 when it could not be read (missing, backend error)."""

    @abstractmethod
    def put_small(self, names: Sequence[str], values: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get_small(self, names: Sequence[str], limit: int | None = None) -> list[bytes | None]:
        """Each named object's bytes, or None (absent, empty, or longer than
        ``limit`` bytes: such an object is never read whole, so a store
        writer cannot make a lookup or load read gigabytes)."""

    @abstractmethod
    def remove(self, names: Sequence[str]) -> list[bool]:
        """Delete objects; True where the object is gone (or never was)."""

    #: A Pin hint's G3 side. ``pin_needs_bytes``: the backend pins by
    #: rewriting the objects (``pin`` gets their bytes); ``pin_lapses``: the
    #: backend ends the pin by itself, else the tier calls ``unpin`` at expiry.
    pin_needs_bytes: ClassVar[bool] = False
    pin_lapses: ClassVar[bool] = True

    def pin(
        self, names: Sequence[str], ttl_s: float, values: Sequence[memoryview] | None
    ) -> list[bool]:
        """Keep objects from the backend's eviction for ``ttl_s``; True where
        an object is now pinned. ``values``, when ``pin_needs_bytes``: each
        object whole (the chunk's bytes, then its seal), in a buffer given to
        ``register``, which the call reads until it returns. By default a
        backend cannot pin."""
        return [False] * len(names)

    def unpin(self, names: Sequence[str], left_s: Sequence[float]) -> None:
        """End this engine's pins of objects (``pin_lapses`` false): at their
        expiry (``left_s`` 0 each) or at shutdown (how long each had left).
        Where other engines pin an object too, the longest pin holds."""
        return

    def close(self) -> None:
        return
