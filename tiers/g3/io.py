"""What G3 backend calls run under: deadlines and a breaker (``Guard``), the
small registered buffers calls read and write checksums in (``Staging``),
and the G2 slots a call past its deadline may still write (``Quarantine``).
See ``tiers/g3/tier.py`` for the rules they implement.

Threading: ``Guard.call`` from any thread (it blocks its caller, never the
scheduler: the tier calls it from its I/O threads and the lookup thread);
``Staging`` and ``Quarantine`` from any thread.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
from vllm.logger import init_logger

logger = init_logger(__name__)
MIN_RATE = 100e6  # bytes/s a healthy backend sustains, for deadlines


class BackendDown(Exception):
    """The backend did not answer in time, or the breaker is open.
    ``abandoned``: the call is still running (it may still write into the
    buffers it was given)."""

    def __init__(self, why: str, abandoned: bool = False):
        super().__init__(why)
        self.abandoned = abandoned


class Guard:
    """Backend calls with deadlines, and a breaker (see the module docstring).

    The breaker stays open while an abandoned call is still running (some
    clients busy-poll while a peer does not answer: one such call at a time),
    and its retry delay doubles with each trip in a row, up to
    ``MAX_BACKOFF`` times ``retry_s``; an answer in time resets it."""

    MAX_BACKOFF = 8

    def __init__(
        self,
        name: str,
        timeout_s: float,
        retry_s: float,
        threads: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._name = name
        self.timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"sessionkv-{name}-call")
        self._permits = threading.BoundedSemaphore(threads)  # held by a call until it returns
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._in_a_row = 0
        self._abandoned = 0  # calls past their deadline, still running
        self.trips = 0

    @property
    def abandoned(self) -> int:
        """Calls past their deadline that are still running."""
        with self._lock:
            return self._abandoned

    @property
    def down(self) -> bool:
        return self._abandoned > 0 or self._clock() < self._down_until

    def trip(self, why: str) -> None:
        with self._lock:
            delay = self._retry_s * min(2**self._in_a_row, self.MAX_BACKOFF)
            if self._clock() >= self._down_until:
                logger.warning(
                    "sessionkv: G3 %s %s: misses for %.1f s, then retrying", self._name, why, delay
                )
            self._down_until = self._clock() + delay
            self._in_a_row += 1
            self.trips += 1

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        nbytes: int = 0,
        on_abandoned: Callable[[Any], None] | None = None,
    ) -> Any:
        """``fn(*args)`` within its deadline, or ``BackendDown``. A call past
        its deadline keeps running; ``on_abandoned(result)`` runs when it
        ends (``None`` when it raised)."""
        return self.start(fn, *args, nbytes=nbytes, on_abandoned=on_abandoned)()

    def start(
        self,
        fn: Callable[..., Any],
        *args: Any,
        nbytes: int = 0,
        on_abandoned: Callable[[Any], None] | None = None,
    ) -> Callable[[], Any]:
        """``call``, started now on a call thread: returns the function that
        waits for its result (by the deadline counted from now), so the
        caller can work meanwhile. Call that function exactly once."""
        if self.down:
            raise BackendDown(f"{self._name} is down")
        if not self._permits.acquire(blocking=False):
            self.trip("has every call thread busy")
            raise BackendDown(f"{self._name}: every call thread is busy")
        state = {"abandoned": False}

        def run():
            result = None
            try:
                result = fn(*args)
                return result
            finally:
                self._permits.release()
                with self._lock:
                    late = state["abandoned"]
                    if late:
                        self._abandoned -= 1
                if late and on_abandoned is not None:
                    on_abandoned(result)

        deadline = self.deadline(nbytes)
        fut = self._pool.submit(run)

        def result() -> Any:
            try:
                value = fut.result(max(deadline - self._clock(), 0.0))
            except FutureTimeout:
                with self._lock:
                    if not fut.done():
                        state["abandoned"] = True
                        self._abandoned += 1
                if not state["abandoned"] and fut.exception() is None:  # made it after all
                    return fut.result()
                self.trip(f"call {getattr(fn, '__name__', fn)} timed out")
                raise BackendDown(f"{self._name}: no answer in time", abandoned=True) from None
            except BackendDown:
                raise
            except Exception as e:
                self.trip(f"call failed: {e!r}")
                raise BackendDown(f"{self._name}: {e!r}") from e
            self._in_a_row = 0
            return value

        return result

    def deadline(self, nbytes: int = 0) -> float:
        """The monotonic time a call moving ``nbytes`` must end by."""
        return self._clock() + self.timeout_s + nbytes / MIN_RATE

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Quarantine:
    """G2 slots that a backend call may still write into.

    A load that reads straight into G2 slots ``hold``s them before its call
    and ``release``s them when the call ends, in time or long after its
    deadline. The primary tier (G2) frees slots through ``park``: a held slot
    is kept out of its free list until released, then handed back by
    ``reclaim``; ``reset`` does the same for every held slot when G2 is
    cleared. So vLLM never gives a slot to new KV while a late read can still
    overwrite it.

    Threading: ``hold``/``release`` from the tier's threads; ``park``,
    ``reclaim`` and ``reset`` from the primary tier's owner (under its lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # slot -> calls holding it
        self._parked: set[int] = set()  # held slots G2 has freed
        self._returned: list[int] = []  # parked slots released, not reclaimed yet

    @property
    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def hold(self, slots: Iterable[int]) -> None:
        with self._lock:
            for s in slots:
                self._held[s] = self._held.get(s, 0) + 1

    def release(self, slots: Iterable[int]) -> None:
        with self._lock:
            for s in slots:
                left = self._held[s] - 1
                if left:
                    self._held[s] = left
                    continue
                del self._held[s]
                if s in self._parked:
                    self._parked.discard(s)
                    self._returned.append(s)

    def park(self, slot: int) -> bool:
        """True when ``slot`` is held: it is the quarantine's until released."""
        if slot not in self._held:
            # One read, atomic under the GIL, without the lock: G2 frees every
            # evicted slot here (a decode step's store evicts one), and a
            # slot can only be held by a load that holds it before G2 could
            # free it (the load's own slot, freed when the load is abandoned).
            return False
        with self._lock:
            if slot not in self._held:
                return False
            self._parked.add(slot)
            return True

    def reclaim(self) -> list[int]:
        """Parked slots released since the last call: free again."""
        if not self._returned:  # vLLM asks per store; one released now comes next call
            return []
        with self._lock:
            out, self._returned = self._returned, []
            return out

    def reset(self) -> set[int]:
        """G2 was cleared: every held slot is parked; returns them (the free
        list must leave them out). Released, unreclaimed slots are dropped:
        the cleared free list has them already."""
        with self._lock:
            self._returned = []
            self._parked = set(self._held)
            return set(self._held)


class Staging:
    """Registered host buffers of fixed-size slots that backend calls read
    into or write from. ``take`` blocks (an I/O thread) until enough slots
    are free; a call past its deadline keeps its slots until it ends."""

    def __init__(self, slots: int, chunk: int):
        self.buffer = np.empty((slots, chunk), np.uint8)
        # numpy's stubs give ndarray ``__buffer__`` on Python 3.12+ only.
        self._view = memoryview(self.buffer).cast("B")  # type: ignore[arg-type]
        self._chunk = chunk
        self._free = list(range(slots))
        self._cond = threading.Condition()

    @property
    def view(self) -> memoryview:
        return self._view

    @property
    def slots(self) -> int:
        return len(self.buffer)

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def take(self, n: int, timeout_s: float) -> list[int] | None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout_s):
                return None
            got, self._free = self._free[:n], self._free[n:]
            return got

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def slot(self, i: int) -> memoryview:
        return self._view[i * self._chunk : (i + 1) * self._chunk]

    def release(self) -> None:
        self._view.release()


class Lapses:
    """Names whose pins end at given times, and one daemon thread that hands
    the lapsed ones to ``on_lapse(names, left_s)`` (for backends whose pins do
    not end by themselves; ``left_s`` 0 each); ``close`` hands it the pins
    still running, with how long each had left. A name pinned again keeps its
    latest expiry. Memory: one entry per pinned name and per ``add``."""

    def __init__(
        self,
        on_lapse: Callable[[list[str], list[float]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._on_lapse = on_lapse
        self._clock = clock
        self._until: dict[str, float] = {}
        self._heap: list[tuple[float, int, list[str]]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, names: list[str], until: float) -> None:
        if not names:
            return
        with self._cond:
            for n in names:
                self._until[n] = max(until, self._until.get(n, until))
            self._seq += 1
            heapq.heappush(self._heap, (until, self._seq, list(names)))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="sessionkv-g3-lapses"
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > self._clock()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - self._clock())
                if self._closed:
                    return
                _, _, names = heapq.heappop(self._heap)
                now = self._clock()
                due = [n for n in names if self._until.get(n, now + 1) <= now]
                for n in due:
                    del self._until[n]
            if due:
                self._end(due, [0.0] * len(due))

    def _end(self, names: list[str], left_s: list[float]) -> None:
        try:
            self._on_lapse(names, left_s)
        except Exception:  # the backend is down: the objects keep the pin for now
            logger.warning(
                "sessionkv: G3 pins of %d objects could not be ended (%s...)", len(names), names[0]
            )

    def close(self) -> None:
        """Stop, and end the pins still running (a graceful shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            now = self._clock()
            running, self._until = self._until, {}
            self._heap = []
        if running:
            self._end(list(running), [u - now for u in running.values()])
