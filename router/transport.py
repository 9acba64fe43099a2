"""The router's hint transport: what the planner (``hinting.HintPlanner``)
decided, sent to the engines over their control channels and counted. It
decides nothing.

- ``hint``: one control hint (``Hint``), awaited; with its ``wait_s``, then
  the final outcome of a deferred one and the transfer it made;
- ``end``: a session's end on a worker (``End``), awaited;
- ``queue``: the Retain ranking's paced hints (``Send``) into one bounded
  outbox (``OUTBOX``; more are dropped, counted), which ``run`` sends in
  order, one envelope each, feeding their outcomes back to the planner;
- ``count``: every outcome logged and counted by how it came (``via``:
  ``request``, ``control``, ``policy``, ``final``).

An engine that is away loses the hint, never the turn: nothing here raises,
a failure is logged and counted (``hint_errors``).

Threading: the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from sessionkv.events import Transfer
from sessionkv.hints import HintOutcome
from sessionkv.router.hinting import End, Hint, HintPlanner, Send
from sessionkv.router.metrics import Counters
from sessionkv.router.workers import Worker

log = logging.getLogger("sessionkv.router")
OUTBOX = 10_000  # paced hints waiting for the control channel (more are dropped, counted)


class HintTransport:
    """Sends and counts the planner's hints (see the module docstring);
    ``workers``: the router's, by name (read at each send)."""

    def __init__(self, workers: Mapping[str, Worker], counters: Counters, planner: HintPlanner):
        self._workers = workers
        self._counters = counters
        self._planner = planner
        self._outbox: asyncio.Queue[Send] = asyncio.Queue(OUTBOX)

    def count(self, worker: str, session_id: str, outcome: HintOutcome, via: str) -> None:
        """One outcome of a hint, logged and counted under ``via``."""
        self._counters.outcome(outcome, via)
        log.info(
            "hint %s %s on %s for %s: %s %d/%d %s",
            outcome.hint_id,
            outcome.action,
            worker,
            session_id,
            getattr(outcome.status, "value", outcome.status),
            outcome.blocks_affected,
            outcome.blocks_asked,
            outcome.reason,
        )

    def final(self, worker: Worker, outcome: HintOutcome) -> None:
        """A deferred hint's final outcome, from ``worker``'s event log."""
        self.count(worker.name, "-", outcome, "final")

    async def hint(self, h: Hint) -> tuple[HintOutcome | None, Transfer | None]:
        """Send ``h`` and count it; its first outcome, or with ``h.wait_s`` its
        final one and transfer (the first and None when the final did not
        come in time); (None, None) when it failed."""
        worker = self._workers[h.worker]
        try:
            self._counters.sent("control")
            first = await worker.hint(h.action, h.session, **h.params)
        except Exception as e:  # the engine is away: the hint is lost, the turn is not
            log.warning(
                "hint %s on %s for %s failed: %s", h.action.value, worker.name, h.session, e
            )
            self._counters.event("hint_errors")
            return None, None
        self.count(worker.name, h.session, first, "control")
        if first.status != "deferred" or not h.wait_s:
            return first, None
        final = await worker.final(first.hint_id, h.wait_s)
        if final is None:
            self._counters.event("finals_timed_out")
        return (first, None) if final is None else final

    async def end(self, e: End) -> None:
        """End ``e.session`` on ``e.worker`` and count it."""
        worker = self._workers[e.worker]
        try:
            self._counters.sent("control")
            self.count(worker.name, e.session, await worker.end_session(e.session), "control")
        except Exception as err:
            log.warning("end of %s on %s failed: %s", e.session, worker.name, err)
            self._counters.event("hint_errors")

    def queue(self, outs: Sequence[Send]) -> None:
        """Hand paced hints to the sender (``run``), in order."""
        for o in outs:
            try:
                self._outbox.put_nowait(o)
            except asyncio.QueueFull:
                self._counters.event("policy_hints_dropped")

    async def run(self) -> None:
        """The sender: the outbox's hints to their engines, in order, forever."""
        while True:
            o = await self._outbox.get()
            worker = self._workers.get(o.worker)
            if worker is None or worker.control is None:
                continue
            try:
                self._counters.sent("policy", len(o.actions))
                outcomes = await worker.hints(o.session, o.actions)
            except Exception as e:  # the engine is away: these hints are lost
                log.warning("policy hints on %s for %s failed: %s", worker.name, o.session, e)
                self._counters.event("hint_errors")
                continue
            for outcome in outcomes:
                self.count(worker.name, o.session, outcome, "policy")
                self._planner.outcome(
                    outcome.action or "?", str(getattr(outcome.status, "value", outcome.status))
                )
