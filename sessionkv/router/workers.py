"""The router's view of one engine: its load, its health, and its control
channel with the final outcomes that arrive on the event stream.

Load is the engine's own count of requests running and waiting (vLLM's
``/metrics``, read every ``load_poll_s``), or the requests this router has in
flight there when that is higher (a poll is up to ``load_poll_s`` old).

Events are read from the engine's log (op ``events``) after the last ``seq``
seen, woken by the event stream and at least once a second, so none is lost
to the stream's slow start or a dropped message. Deferred hints' final
outcomes (``via: transfer``) resolve waiters; the ``transfer`` event just
before a final outcome names the chunks it moved (a Share's keys, which a
Prefetch on another worker asks for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from typing import Any

import aiohttp

from sessionkv.client import AsyncHintClient, ControlError
from sessionkv.events import Outcome, Transfer
from sessionkv.hints import Action, HintOutcome, envelope, hint_action
from sessionkv.router.config import WorkerConfig

log = logging.getLogger("sessionkv.router")
FINALS_KEPT = 1024


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Worker:
    """One engine (see the module docstring). ``start`` before use."""

    def __init__(self, cfg: WorkerConfig, secret: bytes, http: aiohttp.ClientSession,
                 load_poll_s: float, on_final=None):
        self.cfg = cfg
        self.name = cfg.name
        self.url = cfg.url
        self._secret = secret
        self._http = http
        self._poll_s = load_poll_s
        self._on_final = on_final            # called with (worker, HintOutcome)
        self.engine_load = 0.0
        self.inflight = 0
        self.healthy = False
        self.control: AsyncHintClient | None = None
        self._seq = 0
        self._waiters: dict[str, asyncio.Future] = {}
        self._finals: OrderedDict[str, tuple[HintOutcome, Transfer | None]] = OrderedDict()
        self._last_transfer: Transfer | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._polled = asyncio.Event()

    @property
    def load(self) -> float:
        return max(self.engine_load, float(self.inflight))

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "healthy": self.healthy,
                "load": self.load, "engine_load": self.engine_load, "inflight": self.inflight}

    async def start(self) -> None:
        endpoint = self.cfg.control
        if endpoint is None:
            with open(self.cfg.endpoint_file, encoding="utf-8") as f:
                endpoint = json.load(f)["control"]
        self.control = AsyncHintClient(endpoint, self._secret, client_id=f"router-{self.name}")
        self._seq = (await self.control.events(1 << 62, 0)).next_seq - 1
        self._tasks = [asyncio.create_task(self._poll_load()),
                       asyncio.create_task(self._follow()),
                       asyncio.create_task(self._wake_on_stream())]
        await self._polled.wait()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.control is not None:
            self.control.close()

    # ---- load --------------------------------------------------------------------

    async def _poll_load(self) -> None:
        while True:
            try:
                async with self._http.get(self.url + "/metrics",
                                          timeout=aiohttp.ClientTimeout(total=5)) as r:
                    text = await r.text()
                    r.raise_for_status()
                self.engine_load = (_metric_sum(text, "vllm:num_requests_running")
                                    + _metric_sum(text, "vllm:num_requests_waiting"))
                self.healthy = True
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                if self.healthy:
                    log.warning("worker %s unhealthy: %s", self.name, e)
                self.healthy = False
            self._polled.set()
            await asyncio.sleep(self._poll_s)

    # ---- hints and their outcomes -----------------------------------------------

    async def hint(self, action: Action, session_id: str, **kw: Any) -> HintOutcome:
        """One control-channel hint about ``session_id`` (its target unless
        ``keys`` are given); its first outcome (``deferred`` ones resolve
        later: ``final``)."""
        act = hint_action(action, session_id=None if "keys" in kw else session_id, **kw)
        self._waiters.setdefault(act["action_id"], asyncio.get_running_loop().create_future())
        try:
            (outcome,) = await self.control.hints(envelope(act), session_id)
        except BaseException:
            self._waiters.pop(act["action_id"], None)
            raise
        if outcome.status != "deferred":
            self._waiters.pop(act["action_id"], None)
        return outcome

    async def final(self, hint_id: str, timeout_s: float
                    ) -> tuple[HintOutcome, Transfer | None] | None:
        """A deferred hint's final outcome and the transfer it made; None when
        it did not come within ``timeout_s``."""
        if hint_id in self._finals:
            return self._finals[hint_id]
        fut = self._waiters.setdefault(hint_id, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def end_session(self, session_id: str) -> HintOutcome:
        return await self.control.end_session(session_id)

    async def _wake_on_stream(self) -> None:
        while True:
            try:
                async for _ in self.control.stream(kinds=("transfer", "outcome")):
                    self._wake.set()
            except (ControlError, OSError) as e:
                log.warning("worker %s: event stream: %s", self.name, e)
            await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            try:
                while True:
                    page = await self.control.events(self._seq, 1000)
                    for ev in page.events:
                        self._event(ev)
                        self._seq = ev.seq
                    if len(page.events) < 1000:
                        break
            except ControlError as e:
                log.warning("worker %s: events: %s", self.name, e)
            await asyncio.sleep(0.1)     # at most ~10 reads a second under a busy stream

    def _event(self, ev) -> None:
        if isinstance(ev, Transfer) and "G1" not in (ev.src, ev.dst):
            self._last_transfer = ev
        elif isinstance(ev, Outcome) and ev.via == "transfer":
            t = self._last_transfer
            moved = t if t is not None and t.seq == ev.seq - 1 else None
            hint_id = ev.outcome.hint_id
            self._finals[hint_id] = (ev.outcome, moved)
            while len(self._finals) > FINALS_KEPT:
                self._finals.popitem(last=False)
            fut = self._waiters.pop(hint_id, None)
            if fut is not None and not fut.done():
                fut.set_result((ev.outcome, moved))
            if self._on_final is not None:
                self._on_final(self, ev.outcome)
