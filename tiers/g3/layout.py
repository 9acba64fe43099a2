"""The backend modes of a G3 tier as small strategy objects, chosen once from
the backend's flags (``ObjectBackend``): where each chunk's checksum lives
(a ``Layout``: how stores write it and loads verify it), and how a Pin holds
objects (``Pins``). ``G3Tier`` holds one of each and never asks a flag again;
``tiers/g3/tier.py`` has the rules they implement (never wrong KV, never blocking).

- ``InlineSums``: the checksum travels after the chunk's bytes in its own
  object (Mooncake; LMCache also keeps checksum objects for lookups). Loads
  read straight into the G2 slots, which stay in quarantine while a call past
  its deadline may still write them, and verify them there. vLLM's cascades
  put without asking first (a second put keeps one whole object).
- ``SumObjects``: the checksum in an object of its own, written after the data
  object (Redis). Loads read both into the backend's own buffers and copy
  verified bytes into G2; stores ask first (a second put would leave data and
  checksum disagreeing for a moment).
- ``ObjectPins`` pins the objects by name; ``RewritePins`` rewrites them from
  their G2 bytes (Mooncake sets pins only on put), staged a slice at a time
  in a registered buffer of ``PIN_SLICE_BYTES``. Either goes to the backend
  in bounded slices, and may end by itself (``pin_lapses``) or be ended by
  the tier at expiry (``Lapses``).

Threading: every method runs on a tier's I/O thread (or the lookup thread
for ``listing``); ``Staging`` and ``Quarantine`` are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from vllm.logger import init_logger

from sessionkv.tiers.g3.backend import SUM, SUM_SUFFIX, ObjectBackend, Seal
from sessionkv.tiers.g3.io import MIN_RATE, BackendDown, Guard, Lapses, Quarantine, Staging

logger = init_logger(__name__)
SUM_SLOTS = 4096  # checksums in flight in inline-sum calls (64 KiB)
# A Pin goes to the backend in slices (``Pins``): at most PIN_SLICE_CHUNKS
# chunks a call and, where the backend rewrites the objects, at most
# PIN_SLICE_BYTES of them (one object at least), the size of the registered
# buffer they are staged in. Mooncake upserted 512 KiB and 2 MiB objects at
# 1.1-1.2 GB/s here from 2-8 MiB a call, 1.3 at best (16 MiB), less past it.
PIN_SLICE_CHUNKS = 1024
PIN_SLICE_BYTES = 4 << 20

Forget = Callable[[list[str]], None]


class Layout:
    """Where a chunk's checksum lives. ``listing``: the suffix lookups and
    stores ask about (the checksum object, or "" for the data object)."""

    # Whether cascades ask before a put: each layout's default (a class
    # attribute), then the instance's own (``__init__``).
    cascade_asks: bool

    def __init__(self, backend: ObjectBackend, guard: Guard, chunk: int, seal: Seal):
        self._backend = backend
        self._guard = guard
        self._chunk = chunk
        self.seal = seal
        self.listing = SUM_SUFFIX if backend.sum_objects else ""
        # Cascades ask too where a put may keep another object and say nothing.
        self.cascade_asks = type(self).cascade_asks or not backend.put_replaces

    def objects(self, name: str) -> list[str]:
        """Every object that holds the chunk ``name``, the data object first."""
        return [name, name + SUM_SUFFIX] if self.listing else [name]

    def asked(self, names: list[str]) -> list[str]:
        """The objects whose existence lookups and stores ask about, to learn
        whether chunks are there (``present`` folds the answers per chunk)."""
        return [n + self.listing for n in names]

    def present(self, exists: list[bool]) -> list[bool]:
        return list(exists)

    def forget_all(self, names: list[str]) -> None:
        """Remove every object of these chunks, the listed one first."""
        self._forget([o for n in names for o in reversed(self.objects(n))])

    def _forget(self, names: list[str]) -> None:
        try:
            self._backend.remove(names)
        except Exception:  # best effort: such objects are never listed
            pass

    def put(self, names: list[str], chunks: list[memoryview], sums: list[bytes]) -> list[bool]:
        raise NotImplementedError

    def load(
        self, names: list[str], slots: list[memoryview], slot_ids: list[int]
    ) -> tuple[list[bool], list[str]]:
        """Read chunks into their G2 ``slots`` (ids ``slot_ids``), verified:
        (ok per chunk, names of objects there but unreadable or different)."""
        raise NotImplementedError

    def close(self) -> None:
        return


class InlineSums(Layout):
    """Checksums after the bytes, in the chunk's own object (see the module docstring)."""

    cascade_asks = False

    def __init__(
        self, backend: ObjectBackend, guard: Guard, chunk: int, seal: Seal, quarantine: Quarantine
    ):
        super().__init__(backend, guard, chunk, seal)
        self._quarantine = quarantine
        self.sums = Staging(SUM_SLOTS, SUM.size)
        backend.register(self.sums.view)

    def put(self, names, chunks, sums):
        # One call writes data (and checksum objects, after). A put past its
        # deadline may read G2 slots vLLM has reused: its checksums were taken
        # before, so such an object fails its load, and its objects are
        # removed when the late put returns.
        return self._with_sums(self._backend.put_summed, names, chunks, sums, [], self.forget_all)

    def load(self, names, slots, slot_ids):
        """Straight into the G2 slots vLLM reserved, verified there against
        the checksums read with them. The slots stay in quarantine while the
        call runs, past its deadline too; a slot that fails is reported
        failed and never becomes loadable."""
        got = self._with_sums(self._backend.get_summed, names, slots, None, slot_ids, None)
        ok, broken = [], []
        for name, (size, want), slot in zip(names, got, slots):
            good = size == len(slot) and want == self.seal(name, slot)
            # There, but short, long or different; or, with checksum objects
            # (the chunk was listed), its data object gone: an orphan.
            if size is not None and not good and (size >= 0 or self.listing):
                broken.append(name)
            ok.append(good)
        return ok, broken

    def _with_sums(
        self,
        fn,
        names: list[str],
        chunks: list[memoryview],
        values: list[bytes] | None,
        held: list[int],
        on_late: Forget | None,
    ) -> list:
        """``fn(names, chunks, sums)`` in parts of at most a quarter of the
        checksum slots: a put's checksums (``values``) are copied into the
        slots first; the G2 slots ``held`` (one per chunk, for a read) stay in
        quarantine until the call ends. A call past its deadline keeps its
        checksum and G2 slots until it ends, then ``on_late(its names)`` runs.
        Per chunk: a put's result, or a read's (size, checksum bytes); a part
        with no free checksum slots fails (a read's size None: not read)."""
        out: list = []
        fill = values is not None
        step = self.sums.slots // 4
        for i in range(0, len(names), step):
            part, bufs, hold = names[i : i + step], chunks[i : i + step], held[i : i + step]
            taken = self.sums.take(len(part), self._guard.timeout_s)
            if taken is None:  # every slot kept by calls past their deadline
                out += [False if fill else (None, b"")] * len(part)  # not read
                continue
            sums = [self.sums.slot(t) for t in taken]
            if values is not None:  # ``fill``
                for slot, value in zip(sums, values[i : i + step]):
                    slot[:] = value
            self._quarantine.hold(hold)

            def end(late: bool, part=part, taken=taken, hold=hold) -> None:
                if late and on_late is not None:
                    on_late(part)
                self._quarantine.release(hold)
                self.sums.give(taken)

            abandoned = False
            try:
                got = self._guard.call(
                    fn,
                    part,
                    bufs,
                    sums,
                    nbytes=len(part) * self._chunk,
                    # mypy types no lambda with a default against Callable[[Any], None]
                    on_abandoned=lambda _, end=end: end(True),  # type: ignore[misc]
                )
                out += got if fill else [(size, bytes(s)) for size, s in zip(got, sums)]
            except BackendDown as e:
                abandoned = e.abandoned
                raise
            finally:
                if not abandoned:
                    end(False)
        return out

    def close(self) -> None:
        self.sums.release()


class SumObjects(Layout):
    """Checksums in objects of their own (see the module docstring)."""

    cascade_asks = True

    # Both objects: the backend evicts them one by one (Redis' volatile-lru),
    # and a chunk with only one of them is absent (a lookup that trusted the
    # checksum object alone said HIT for evicted data, and every load failed).
    def asked(self, names):
        return [o for n in names for o in (n, n + SUM_SUFFIX)]

    def present(self, exists):
        return [a and b for a, b in zip(exists[::2], exists[1::2])]

    def put(self, names, chunks, sums):
        b, g = self._backend, self._guard
        # Zero-copy from G2: a put past its deadline may read a slot vLLM has
        # reused. Its object then gets no checksum object (never listed), and
        # is removed when the late put returns.
        put = g.call(
            b.put_chunks,
            names,
            chunks,
            nbytes=len(names) * self._chunk,
            on_abandoned=lambda _: self._forget(names),
        )
        # Checksum objects after the data: lookups find whole chunks.
        stored = [j for j, p in enumerate(put) if p]
        listed = g.call(
            b.put_small, [names[j] + SUM_SUFFIX for j in stored], [sums[j] for j in stored]
        )
        ok = [False] * len(put)
        for j, done in zip(stored, listed):
            ok[j] = done
        return ok

    def load(self, names, slots, slot_ids):
        """Data and checksum objects in one ``get_small`` call, verified bytes
        copied straight into G2: the backend's buffers are its own, so a
        call past its deadline writes nothing of ours."""
        got = self._guard.call(
            self._backend.get_small,
            names + [n + SUM_SUFFIX for n in names],
            self._chunk,
            nbytes=len(names) * self._chunk,
        )
        ok, broken = [], []
        for name, slot, value, want in zip(names, slots, got, got[len(names) :]):
            good = (
                value is not None
                and len(value) == self._chunk
                and want is not None
                and want == self.seal(name, value)
            )
            # There, but short, long or different; or one of its two objects
            # gone (the other is an orphan).
            if (value is not None or want is not None) and not good:
                broken.append(name)
            if good:
                slot[:] = value
            ok.append(good)
        return ok, broken


def layout_for(
    backend: ObjectBackend, guard: Guard, chunk: int, seal: Seal, quarantine: Quarantine
) -> Layout:
    """The backend's layout; a clear error for flags no layout serves."""
    if backend.inline_sums:
        return InlineSums(backend, guard, chunk, seal, quarantine)
    if backend.owned_reads and backend.sum_objects:
        return SumObjects(backend, guard, chunk, seal)
    raise TypeError(
        f"{type(backend).__name__}: a backend keeps checksums inline "
        "(inline_sums) or in checksum objects it reads with its data "
        "(sum_objects, owned_reads)"
    )


class Pins:
    """A Pin hint's G3 side: keep chunks' objects from the backend's eviction
    for a TTL, ended by the backend or, at expiry, by ``Lapses``.

    A pin goes to the backend in slices of at most ``slice`` chunks, one
    call each under its own deadline: a long session's Pin holds one
    slice's memory at a time and no call outlasts a modest transfer. Once
    the backend is down (``BackendDown``: no answer in time, or the breaker
    open) the rest fails without a call; a slice whose call raised
    otherwise (a backend bug) fails alone. A slice's pins are handed to
    ``Lapses`` as it ends, so earlier slices' pins end at expiry even when
    a later slice fails."""

    #: whether ``pin`` needs the chunks' G2 slots (the backend rewrites them)
    needs_bytes: ClassVar[bool]

    def __init__(self, backend: ObjectBackend, guard: Guard, layout: Layout, clock):
        self._backend = backend
        self._guard = guard
        self._layout = layout
        self._clock = clock
        self._lapses = None if backend.pin_lapses else Lapses(self._unpin)
        self.slice = PIN_SLICE_CHUNKS

    def pin(self, names: list[str], slots: list[int] | None, ttl_s: float) -> list[bool]:
        """Pin the chunks ``names`` (``slots``: their G2 slots, where
        ``needs_bytes``): True per chunk whose objects are pinned. Raises
        only for missing ``slots``."""
        if self.needs_bytes and slots is None:
            raise ValueError("pinning rewrites objects: G2 slots needed")
        ok: list[bool] = []
        for i in range(0, len(names), self.slice):
            part = names[i : i + self.slice]
            try:
                got = self._pin(part, None if slots is None else slots[i : i + self.slice], ttl_s)
            except BackendDown as e:
                logger.debug("sessionkv: G3 pin: %s", e)
                break
            except Exception:  # a backend bug fails the slice, never the engine
                logger.exception("sessionkv: G3 pin failed")
                got = [False] * len(part)
            if self._lapses is not None:
                pinned = [o for n, k in zip(part, got) if k for o in self._layout.objects(n)]
                self._lapses.add(pinned, self._clock() + ttl_s)
            ok += got
        return ok + [False] * (len(names) - len(ok))

    def _pin(self, names: list[str], slots: list[int] | None, ttl_s: float) -> list[bool]:
        """One slice: one backend call."""
        raise NotImplementedError

    def _unpin(self, names: list[str], left_s: list[float]) -> None:
        self._guard.call(self._backend.unpin, names, left_s)

    def close(self) -> None:
        if self._lapses is not None:
            self._lapses.close()


class ObjectPins(Pins):
    """Pins by object name: every object of a chunk, the chunk pinned when all are."""

    needs_bytes = False

    def _pin(self, names, slots, ttl_s):
        per = 2 if self._layout.listing else 1  # objects per chunk
        got = self._guard.call(
            self._backend.pin, [o for n in names for o in self._layout.objects(n)], ttl_s, None
        )
        return [all(got[i : i + per]) for i in range(0, len(got), per)]


class RewritePins(Pins):
    """Pins by rewriting each object (bytes and inline checksum) from its G2
    slot in ``region``.

    A slice's objects are staged whole, each the chunk's bytes then its seal
    over exactly those bytes, in a registered buffer (``Staging``) of
    ``PIN_SLICE_BYTES`` (one object at least), and the backend uploads them
    from there (Mooncake: ``batch_upsert_from``, zero-copy): no Python copy
    of the session, and a rewriting pin's memory is that buffer, allocated
    with the tier. A call past its deadline keeps its staging slots until it
    ends, so a late upload still writes the bytes its seal covers; G2 is
    read only before the call. Concurrent pins share the buffer, a slice at
    a time."""

    needs_bytes = True

    def __init__(
        self, backend: ObjectBackend, guard: Guard, layout: Layout, clock, region: memoryview
    ):
        super().__init__(backend, guard, layout, clock)
        self._region = region
        self._chunk = layout._chunk  # a G2 slot's bytes
        size = self._chunk + SUM.size
        self.slice = max(1, min(PIN_SLICE_CHUNKS, PIN_SLICE_BYTES // size))
        self._staging = Staging(self.slice, size)
        backend.register(self._staging.view)

    def _pin(self, names, slots, ttl_s):
        if self._guard.down:  # fail now: a late call may hold the staging slots
            raise BackendDown("the breaker is open")
        size = self._chunk + SUM.size
        # Slots a concurrent pin holds come back within one call's deadline.
        taken = self._staging.take(len(names), self._guard.timeout_s + self.slice * size / MIN_RATE)
        if taken is None:
            return [False] * len(names)
        c, abandoned = self._chunk, False
        try:
            objs = [self._staging.slot(t) for t in taken]
            for name, slot, obj in zip(names, slots, objs):
                obj[:c] = self._region[slot * c : (slot + 1) * c]
                obj[c:] = self._layout.seal(name, obj[:c])
            return self._guard.call(
                self._backend.pin,
                names,
                ttl_s,
                objs,
                nbytes=len(objs) * size,
                on_abandoned=lambda _: self._staging.give(taken),
            )
        except BackendDown as e:
            abandoned = e.abandoned
            raise
        finally:
            if not abandoned:
                self._staging.give(taken)

    def close(self) -> None:
        super().close()
        self._staging.release()


def pins_for(
    backend: ObjectBackend, guard: Guard, layout: Layout, clock, region: memoryview
) -> Pins:
    """The backend's pins; ``region``: G2, which rewriting pins read."""
    if not backend.pin_needs_bytes:
        return ObjectPins(backend, guard, layout, clock)
    if layout.listing:
        raise TypeError(
            f"{type(backend).__name__}: pins that rewrite objects "
            "(pin_needs_bytes) need inline checksums, no checksum objects"
        )
    return RewritePins(backend, guard, layout, clock, region)
