"""G3Objects: what a G3 tier does with a chunk's objects.

``G3Tier`` (``tiers/g3/tier.py``, whose docstring has the rules) is a
``G3Objects``: these are its methods that name a chunk's objects, ask
whether they are there (vLLM's asynchronous lookups), copy one backend
call's worth of chunks (a store's asks, a load's checks), and remember what
the tier learned of objects. Their state is the tier's, set by
``G3Tier._setup`` (listed in the class).

Remembered: the chunks whose objects this tier wrote or verified (the last
``MAX_MINE``: a hint's store of them sends nothing), and the chunks whose
load failed with the backend up (a miss for ``MISS_AFTER_FAILURE_S``, the
last ``MAX_FAILED``); an object found unreadable or failing its seal is
unlisted (``Layout.forget_all``).

Threading: names on any thread; lookups on the lookup manager's thread;
copies on the I/O threads. What is remembered is read and written under the
tier's ``_lock``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from sessionkv.tiers.g3.backend import ObjectBackend, Seal
from sessionkv.tiers.g3.events import StorageEvents
from sessionkv.tiers.g3.fingerprint import fingerprint, plain
from sessionkv.tiers.g3.io import BackendDown, Guard
from sessionkv.tiers.g3.layout import Layout

logger = init_logger(__name__)
#: Told of a copy as it ends: ``(load, keys, ok per key)``; runs on an I/O
#: thread and must not block (the tier manager indexes G3 copies from it).
Observer = Callable[[bool, list[OffloadKey], list[bool]], None]
MISS_AFTER_FAILURE_S = 30.0
MAX_FAILED = 65_536
# Chunks whose objects this tier wrote or verified, remembered so a hint's
# store of them sends nothing (``_store``); one forgotten is written again.
# 262,144 names (as hashes: about 25 MiB) cover a production G2.
MAX_MINE = 1 << 18


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookups, asking the backend for checksum objects."""

    def __init__(self, tier: G3Objects):
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.listed(keys)


class G3Objects(SecondaryTierManager):
    """A G3 tier's names, lookups and data path (see the module docstring)."""

    # The tier's state these read and write (``G3Tier._setup``).
    guard: Guard
    rejected: int
    _backend: ObjectBackend
    _layout: Layout
    _seal: Seal
    _region: memoryview
    _chunk: int
    _namespace: str
    _prefix: str | None
    _identity: dict[str, Any]
    _events: StorageEvents | None
    _observer: Observer | None
    _failed: dict[str, float]
    _own: OrderedDict[int, None]
    _lock: threading.Lock

    # ---- names ----------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """``<namespace>/<fingerprint>/``. Computed at first use: the block
        hash root (``NONE_HASH``) is set after the engine built this tier."""
        if self._prefix is None:
            from vllm.v1.core import kv_cache_utils

            root = getattr(kv_cache_utils, "NONE_HASH", None)
            if root is None:
                raise RuntimeError("vLLM's block hash root is not set: cannot name G3 objects")
            self._identity = {**self._identity, "none_hash": bytes(root)}
            fp = fingerprint(self._identity)
            self._prefix = f"{self._namespace}/{fp}/"
            logger.info("sessionkv: G3 tier %s, objects %s*", self.tier_type, self._prefix)
        return self._prefix

    @property
    def identity(self) -> dict[str, Any]:
        """The fields the fingerprint covers (JSON values), for ``doctor``."""
        _ = self.prefix
        return plain(self._identity)

    def name(self, key: OffloadKey) -> str:
        return self.prefix + bytes(key).hex()

    def objects(self, key: OffloadKey) -> list[str]:
        """The names of every object that holds the chunk ``key``."""
        return self._layout.objects(self.name(key))

    # ---- lookups (the lookup manager's thread) -----------------------------------

    def listed(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether each chunk's checksum object (or, with inline checksums, its
        object) exists; False when the backend does not answer in time."""
        names = self._layout.asked([self.prefix + bytes(k).hex() for k in keys])
        try:
            there = self._layout.present(self.guard.call(self._backend.exists, names))
        except BackendDown:
            return [False] * len(keys)
        if self._events is not None and not all(there):
            self._events.gone([k for k, t in zip(keys, there) if not t])
        return there

    # ---- one backend call's worth of a copy (the I/O threads) ---------------------

    def _copy_batch(
        self,
        load: bool,
        what: str,
        keys: list[OffloadKey],
        names: list[str],
        offsets: list[int],
        cascade: bool,
    ) -> tuple[list[bool], bool]:
        """One backend call's worth of ``_copy``: (ok per key, backend down).
        A load that failed with the backend up is remembered (a miss for a while)."""
        down = False
        try:
            ok = self._load(names, offsets) if load else self._store(names, offsets, cascade)
        except BackendDown as e:  # the breaker covers it: no per-chunk memory
            logger.debug("sessionkv: G3 %s: %s", what, e)
            ok, down = [False] * len(keys), True
        except Exception:  # a backend bug fails the copy, never the engine
            logger.exception("sessionkv: G3 %s failed", what)
            ok = [False] * len(keys)
        if load and not down and not all(ok):
            self._remember_failed([n for n, o in zip(names, ok) if not o])
            if self._events is not None:  # missing, or unlisted as unreadable
                self._events.gone([k for k, o in zip(keys, ok) if not o])
        if self._observer is not None:
            self._observer(load, keys, ok)
        return ok, down

    def _remember_failed(self, names: list[str]) -> None:
        self._disown(names)
        until = time.monotonic() + MISS_AFTER_FAILURE_S
        with self._lock:
            for n in names:
                self._failed.pop(n, None)
                self._failed[n] = until
            while len(self._failed) > MAX_FAILED:
                del self._failed[next(iter(self._failed))]

    def _chunks(self, offsets: list[int]) -> list[memoryview]:
        return [self._region[o : o + self._chunk] for o in offsets]

    def _store(self, names: list[str], offsets: list[int], cascade: bool) -> list[bool]:
        """Store chunks. vLLM's ``cascade`` asks first where the layout says
        (``Layout.cascade_asks``: a second put could hurt, or could keep
        another object and say nothing), and keeps what is there. A hint's copy asks, keeps the chunks this tier wrote or
        verified (``_mine``: vLLM has most often stored them already), and
        replaces any other object under their names (a store writer's,
        planted before a Demote): a copy that says it stored a chunk stored
        these bytes."""
        b, g = self._backend, self.guard
        ask = not cascade or self._layout.cascade_asks
        # Sealed after the existence check: a hint's chunks are most often
        # there already, and a seal reads the whole chunk (a Demote of what
        # write-through stored took the engine's core for a MAC of each).
        if ask:
            there = self._layout.present(g.start(b.exists, self._layout.asked(names))())
            have = there if cascade else [t and m for t, m in zip(there, self._mine(names))]
            # Mooncake keeps an object a put names: the others go first (a
            # put that then fails leaves the chunk absent: a miss).
            stale = [n for n, t, h in zip(names, there, have) if t and not h]
            if stale and not b.put_replaces:
                g.call(b.remove, [o for n in stale for o in reversed(self._layout.objects(n))])
        else:
            have = [False] * len(names)
        chunks = self._chunks(offsets)
        seal = self._layout.seal
        todo = [i for i, h in enumerate(have) if not h]
        ok = list(have)
        if todo:
            put = self._layout.put(
                [names[i] for i in todo],
                [chunks[i] for i in todo],
                [seal(names[i], chunks[i]) for i in todo],
            )
            for i, done in zip(todo, put):
                ok[i] = bool(done)
            # Written: asked and absent (or removed), or over whatever was there.
            self._vouch([names[i] for i, done in zip(todo, put) if done])
        return ok

    def _load(self, names: list[str], offsets: list[int]) -> list[bool]:
        ok, broken = self._layout.load(
            names, self._chunks(offsets), [o // self._chunk for o in offsets]
        )
        self._vouch([n for n, o in zip(names, ok) if o])
        self._unlist(broken)
        return ok

    def _vouch(self, names: list[str]) -> None:
        """Remember that these chunks' objects hold what their seal says (this
        tier wrote or verified them), the last ``MAX_MINE`` names."""
        with self._lock:
            own = self._own
            for n in names:
                h = hash(n)
                if h in own:
                    own.move_to_end(h)
                else:
                    own[h] = None
            while len(own) > MAX_MINE:
                own.popitem(last=False)

    def _mine(self, names: list[str]) -> list[bool]:
        with self._lock:
            return [hash(n) in self._own for n in names]

    def _disown(self, names: list[str]) -> None:
        with self._lock:
            for n in names:
                self._own.pop(hash(n), None)

    def _unlist(self, broken: list[str]) -> None:
        if broken:
            with self._lock:
                self.rejected += len(broken)
            logger.warning(
                "sessionkv: %d G3 objects unreadable or failing their %s "
                "(%s...): recomputing, and unlisting them",
                len(broken),
                "MAC" if self._seal.key else "checksum",
                broken[0],
            )
            self._layout.forget_all(broken)
