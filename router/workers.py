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
Prefetch on another worker asks for). Every event also feeds the worker's
``OverlapIndex`` (its G1/G2 blocks, for overlap routing); on start the index
reads the history the engine still keeps. An engine whose log restarted
(``next_seq`` below the last seen: the engine was restarted) is read again
from its start, its index cleared.

Health: a worker is healthy while its ``/metrics`` answers; it turns
unhealthy after ``FAILED_POLLS_UNHEALTHY`` polls in a row fail. One slow reply
is not a dead engine: a poll that timed out while the machine was saturated
(seen in CI: two engines decoding on two cores) would otherwise move every
session off a live worker, and a move off an unhealthy worker is a failover,
which Shares nothing. A turn that fails
on it asks ``alive`` (``GET /health``, 2 s); a worker that does not answer is
marked dead at once (``mark_dead``) so that no turn waits for the next poll.
On start the router asks the engine to ``probe`` a fixed prompt and builds its
own ``BlockHasher`` from the answer (``overlap.py``); ``hasher`` stays None
(no overlap routing for this worker) when the hashes do not match.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections import OrderedDict
from typing import Any

import aiohttp

from sessionkv.client import AsyncHintClient, ControlError
from sessionkv.events import Outcome, Transfer
from sessionkv.hints import Action, HintOutcome, envelope, hint_action
from sessionkv.router.config import WorkerConfig
from sessionkv.router.overlap import PROBE_TOKENS, BlockHasher, OverlapIndex, ProbeMismatch

log = logging.getLogger("sessionkv.router")
FINALS_KEPT = 1024
MAX_SAMPLE = 1e9  # a /metrics request count past this is unreadable


class DataParallelWorker(ValueError):
    """A worker is a data-parallel engine, which this router cannot address
    per rank: the router does not start."""


def _metric_sum(text: str, name: str) -> tuple[float, int]:
    """The sum of a metric's samples in Prometheus text, and how many samples
    of it had no readable value (skipped)."""
    total, bad = 0.0, 0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            # The value follows the labels (which may hold spaces); a timestamp may follow it.
            fields = line[line.rfind("}") + 1 if "}" in line else len(name) :].split()
            try:
                value = float(fields[0])
            except (IndexError, ValueError):
                bad += 1
                continue
            if 0 <= value <= MAX_SAMPLE:  # request counts: finite, not negative
                total += value
            else:
                bad += 1
    return total, bad


# Polls in a row that must fail before a worker counts as unhealthy (about
# 3 x load_poll_s after the engine stops answering; a failed turn is faster: mark_dead).
FAILED_POLLS_UNHEALTHY = 3


class Worker:
    """One engine (see the module docstring). ``start`` before use."""

    def __init__(
        self,
        cfg: WorkerConfig,
        secret: bytes,
        http: aiohttp.ClientSession,
        load_poll_s: float,
        on_final=None,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.url = cfg.url
        self._secret = secret
        self._http = http
        self._poll_s = load_poll_s
        self._on_final = on_final  # called with (worker, HintOutcome)
        self.engine_load = 0.0
        self.inflight = 0
        self.draining = False  # POST /router/workers/{name}/drain: no turns while others can
        self.healthy = False
        self._failed_polls = 0
        self.control: AsyncHintClient | None = None
        self._seq = 0
        self._waiters: dict[str, asyncio.Future] = {}
        self._finals: OrderedDict[str, tuple[HintOutcome, Transfer | None]] = OrderedDict()
        self._last_transfer: Transfer | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._polled = asyncio.Event()
        self.index = OverlapIndex()
        self.hasher: BlockHasher | None = None
        self.probe_error: str | None = None
        self.metrics_error: str | None = None  # degraded: load read only in part
        self.bad_events = 0  # events that failed to apply (dropped)
        self.info: dict[str, Any] = {}  # the engine's hello

    @property
    def load(self) -> float:
        return max(self.engine_load, float(self.inflight))

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "load": self.load,
            "engine_load": self.engine_load,
            "inflight": self.inflight,
            "overlap": self.hasher is not None,
            "probe_error": self.probe_error,
            "metrics_error": self.metrics_error,
            "bad_events": self.bad_events,
            "skipped_events": getattr(self.control, "skipped_events", 0),
            "index_keys": len(self.index),
        }

    async def start(self) -> None:
        if self.cfg.plain:
            self.probe_error = "plain worker: no control channel"
            self._tasks = [asyncio.create_task(self._poll_load())]
            await self._polled.wait()
            return
        endpoint = self.cfg.control
        if endpoint is None:
            path = self.cfg.endpoint_file
            assert path is not None  # parse_config: a worker not plain names one of the two
            if os.path.exists(path + ".dp1"):
                raise DataParallelWorker(self._dp_refusal(f"{path}.dp1 exists"))
            with open(path, encoding="utf-8") as f:
                endpoint = json.load(f)["control"]
        # One client id per router process: the engine accepts each client's
        # counters only growing, so two routers (or a restarted one next to
        # its predecessor's last frames) must not share one.
        control = self.control = AsyncHintClient(
            endpoint,
            self._secret,
            client_id=f"router-{self.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        )
        self.info = await self.control.hello()
        dp_size = self.info.get("dp_size", 1)
        if not isinstance(dp_size, int) or dp_size != 1:
            self.control.close()
            raise DataParallelWorker(self._dp_refusal(f"its hello says dp_size {dp_size!r}"))
        self._seq = (await self.control.events(1 << 62, 0)).next_seq - 1
        await self._verify_hashing(control)
        await self._catch_up_index(control, 0, self._seq)
        self._tasks = [
            asyncio.create_task(self._poll_load()),
            asyncio.create_task(self._follow(control)),
            asyncio.create_task(self._wake_on_stream(control)),
        ]
        await self._polled.wait()

    def _dp_refusal(self, why: str) -> str:
        return (
            f"worker {self.name}: a data-parallel engine ({why}). Each DP rank has its own "
            "cache, index and control channel, and this router sends a session's hints to "
            "one channel per worker; run one engine per rank (--data-parallel-size 1), "
            "each a worker of its own"
        )

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.control is not None:
            self.control.close()

    async def _verify_hashing(self, control: AsyncHintClient) -> None:
        try:
            answer = await control.call("probe", tokens=PROBE_TOKENS)
            if not answer.ok:
                raise ProbeMismatch(f"probe refused: {answer.error}")
            self.hasher = BlockHasher.from_probe(answer.info, PROBE_TOKENS)
            self.probe_error = None
        except (ProbeMismatch, ControlError) as e:
            self.hasher, self.probe_error = None, str(e)
            log.warning("worker %s: no overlap routing: %s", self.name, e)
        except Exception as e:  # a reply no check foresaw: degraded, never down
            self.hasher, self.probe_error = None, f"unreadable probe answer: {e!r}"
            log.exception("worker %s: no overlap routing", self.name)

    async def _catch_up_index(self, control: AsyncHintClient, after: int, upto: int) -> None:
        """Feed the index the events the engine keeps in (after, upto]."""
        try:
            while after < upto:
                page = await control.events(after, 1000)
                for ev in page.events:
                    if ev.seq <= upto:
                        self._guarded(self.index.apply, ev)
                if page.last_seq == 0 or page.last_seq >= upto:
                    break
                after = page.last_seq  # past kinds this router skipped
        except ControlError as e:
            log.warning("worker %s: index catch-up: %s", self.name, e)

    # ---- health and load -------------------------------------------------------------

    def mark_dead(self, why: str) -> None:
        if self.healthy:
            log.warning("worker %s marked dead: %s", self.name, why)
        self.healthy = False

    async def alive(self, tries: int = 2, timeout_s: float = 5.0) -> bool:
        """Whether the engine's server answers ``GET /health`` with 200 in one
        of ``tries`` probes. A dead server refuses at once; one slow answer
        (a loaded host) is not death: it would move the session."""
        for _ in range(tries):
            try:
                async with self._http.get(
                    self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
        return False

    # What /tokenize takes of a request body: the chat template's inputs for
    # chat, the special-token choice for both (their defaults are vLLM's:
    # the completions API adds BOS, chat leaves it to the template).
    _CHAT_KEYS = (
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "add_special_tokens",
    )

    async def tokenize(self, body: dict[str, Any], timeout_s: float = 2.0) -> list[int] | None:
        """The prompt's token ids as this engine makes them (its ``/tokenize``,
        with the model's tokenizer and chat template) for a text or chat body;
        None when the body has neither or the engine does not answer in time."""
        if isinstance(body.get("messages"), list):
            req = {k: body[k] for k in self._CHAT_KEYS if k in body}
        elif isinstance(body.get("prompt"), str):
            req = {
                "prompt": body["prompt"],
                "add_special_tokens": body.get("add_special_tokens", True),
            }
        else:
            return None
        if isinstance(body.get("model"), str):
            req["model"] = body["model"]
        try:
            async with self._http.post(
                self.url + "/tokenize", json=req, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                out = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.debug("tokenize on %s failed: %r", self.name, e)
            return None
        toks = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            return None
        return toks

    async def _poll_load(self) -> None:
        while True:
            try:
                async with self._http.get(
                    self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    text = await r.text()
                    r.raise_for_status()
                (running, bad_r), (waiting, bad_w) = (
                    _metric_sum(text, "vllm:num_requests_running"),
                    _metric_sum(text, "vllm:num_requests_waiting"),
                )
                self.engine_load = running + waiting
                self.metrics_error = (
                    f"{bad_r + bad_w} unreadable load samples in /metrics"
                    if bad_r + bad_w
                    else None
                )
                self.healthy, self._failed_polls = True, 0
            except Exception as e:  # any bad reply counts, and the poll goes on
                self._failed_polls += 1
                if self.healthy and self._failed_polls >= FAILED_POLLS_UNHEALTHY:
                    log.warning(
                        "worker %s unhealthy after %d failed polls: %r",
                        self.name,
                        self._failed_polls,
                        e,
                    )
                    self.healthy = False
                elif self.healthy:
                    log.info(
                        "worker %s: load poll failed (%d): %r", self.name, self._failed_polls, e
                    )
            self._polled.set()
            await asyncio.sleep(self._poll_s)

    # ---- hints and their outcomes -----------------------------------------------

    async def hint(self, action: Action, session_id: str, **kw: Any) -> HintOutcome:
        """One control-channel hint about ``session_id`` (its target unless
        ``keys`` are given); its first outcome (``deferred`` ones resolve
        later: ``final``)."""
        if self.control is None:
            raise ControlError(f"worker {self.name}: no control channel")
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

    async def final(
        self, hint_id: str, timeout_s: float
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

    async def hints(self, session_id: str, actions: list[dict[str, Any]]) -> list[HintOutcome]:
        """Several control-channel hints in one envelope; their first outcomes."""
        if self.control is None:
            raise ControlError(f"worker {self.name}: no control channel")
        return await self.control.hints(envelope(*actions), session_id)

    async def end_session(self, session_id: str) -> HintOutcome:
        if self.control is None:
            raise ControlError(f"worker {self.name}: no control channel")
        return await self.control.end_session(session_id)

    async def _wake_on_stream(self, control: AsyncHintClient) -> None:
        while True:
            try:
                async for _ in control.stream(kinds=("transfer", "outcome")):
                    self._wake.set()
            except (ControlError, OSError) as e:
                log.warning("worker %s: event stream: %s", self.name, e)
            await asyncio.sleep(1.0)

    async def _follow(self, control: AsyncHintClient) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            try:
                while True:
                    page = await control.events(self._seq, 1000)
                    if page.next_seq - 1 < self._seq:  # a new engine: a new log
                        log.warning("worker %s: event log restarted", self.name)
                        self._seq = 0
                        self.index.clear()
                        continue
                    if page.oldest > self._seq + 1:
                        log.warning(
                            "worker %s: %d events lost", self.name, page.oldest - self._seq - 1
                        )
                    for ev in page.events:
                        self._event(ev)
                        self._seq = ev.seq
                    self._seq = max(self._seq, page.last_seq)  # past kinds skipped
                    if page.last_seq == 0 or page.last_seq >= page.next_seq - 1:
                        break  # caught up
            except ControlError as e:
                log.warning("worker %s: events: %s", self.name, e)
            await asyncio.sleep(0.1)  # at most ~10 reads a second under a busy stream

    def _event(self, ev) -> None:
        self._guarded(self._apply, ev)

    def _guarded(self, fn, ev) -> None:
        try:
            fn(ev)
        except Exception:  # a bad event is dropped and counted, never fatal
            self.bad_events += 1
            log.exception("worker %s: event %s dropped", self.name, getattr(ev, "seq", "?"))

    def _apply(self, ev) -> None:
        self.index.apply(ev)
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
