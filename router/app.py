"""The reference router: an OpenAI-compatible async reverse proxy in front of
several vLLM engines running ``SessionTierConnector``.

    sessionkv router --config router.yaml

Each turn (``POST /v1/completions`` or ``/v1/chat/completions``, streaming or
not) belongs to a session: the ``X-Session-ID`` header or the body's
``session_id``, else one the router makes (unguessable) and returns in
``X-Session-ID``. A session id belongs to the client (API key) whose turn
named it first: another client's turns in it get 403, its endpoints 404, and
router Pins count against each client's quota. The turn goes where ``policy.choose`` says (affinity, then
KV overlap, then load; state in Redis), with the body's ``session_id`` set and the router's
own hints, signed, in ``kv_transfer_params`` (a client's own ``kv_hints`` are
dropped: only the router signs). Responses pass through unchanged, with
``X-SessionKV-Worker`` naming the worker.

Lifecycle to hints (``policy`` in router.yaml):

- every turn start, turn end and session end goes to the hint policy
  (``retains.SessionHints``: Retains of live sessions, shared
  prefixes and ended heads, ranked by the strategy its shadow caches
  choose per engine), whose hints leave over the control channel in
  batches, paced to the engine's hint rate, from one sender task; a tick
  every second drains them and re-ranks idle sessions every ``tick_s``;
- a turn that ends in a tool call (the client says so with
  ``X-Session-Tool-Gap: <seconds>``, or the response finishes with
  ``tool_calls``), with ``tool_call.pin`` -> also a Pin for the expected gap
  x ``pin_ttl_factor`` (signed, on the request, or over the control
  channel); with ``warmup.enabled``, a one-token request replays the turn's
  prompt ``lead_s`` before the gap's expected end, to bring it into G1;
- a session moved (its worker overloaded) -> Share from the old worker
  (awaited, up to ``move_wait_s``), then with ``share_prefetch`` a Prefetch of
  the shared chunks on the new one, and the old worker ends the session
  (its pins go); the turn then reads the prefix from G3 (or G2 when prefetched);
- a session ended (``POST /v1/sessions/{id}/end`` or idle for
  ``idle_timeout_s``) -> Demote then end (``demote``), end only (``free``),
  on every worker the session went to; the policy watches its head.

Overlap: for a completion whose ``prompt`` is token ids, the router hashes
its full blocks as the engines do (``overlap.py``, checked against each
engine's ``probe`` on start) and scores each worker by the blocks its event
stream says it holds in G1/G2. Text prompts and chat messages are not
tokenized by the router: they route by affinity and load only.

Failover: a worker whose ``/metrics`` stops answering is unhealthy; its
sessions move to the others on their next turn (no Share: the engine is gone;
the new worker finds what write-through put in G3 by itself). A turn whose
worker fails under it (connection refused or dropped) is retried on another
worker when the failed one does not answer ``/health`` (it is marked dead at
once), up to once per worker: greedy turns give the same tokens there.
A worker that answers but failed the turn gives a 502 (no retry: the turn
may have run). A streamed turn is retried only while nothing was sent to the
client; a stream cut later is closed without its end (``streams_cut``).

Every outcome is logged and counted: ``GET /router/status`` (JSON) and
``GET /metrics`` (Prometheus, the same counters: ``router/metrics.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import signal
import time
import uuid
from collections import Counter, OrderedDict
from typing import Any

import aiohttp
from aiohttp import web

from sessionkv.hints import (
    HINTS_PARAM,
    KVCR_PARAM,
    SIG_PARAM,
    Action,
    envelope,
    hint_action,
    id_problem,
    sign,
)
from sessionkv.keys import ROUTER_ADMIN, ROUTER_CLIENT, derive
from sessionkv.report import RequestReport
from sessionkv.router import policy as rules
from sessionkv.router.config import RouterConfig
from sessionkv.router.metrics import RouterMetrics
from sessionkv.router.overlap import score
from sessionkv.router.retain_queue import End, Out
from sessionkv.router.retains import SessionHints
from sessionkv.router.state import ResilientStore, SessionStore, StateError
from sessionkv.router.workers import Worker

log = logging.getLogger("sessionkv.router")
SESSION_HEADER = "X-Session-ID"
OUTBOX = 10_000  # policy hints waiting for the control channel (more are dropped, counted)
WORKER_HEADER = "X-SessionKV-Worker"
# Seconds from the turn's arrival to its forwarding: session state, placement,
# a move's Share wait, the policy's work (benches attribute TTFT with it).
ROUTED_HEADER = "X-SessionKV-Routed-S"
DRAIN_CONCURRENCY = 8  # Demotes in flight at once while a worker drains
KEEPALIVE_S = 4.0  # below the engines' keep-alive (vLLM: 5 s), see start()
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "content-encoding",
    "keep-alive",
}


class _StreamCut(aiohttp.ClientError):
    """The worker failed after part of a streamed turn reached the client."""


class Router:
    """The proxy and its background work; ``start``, then serve ``app``."""

    def __init__(self, cfg: RouterConfig, clock=time.monotonic):
        self.cfg = cfg
        self.counters = rules.Counters()
        self.metrics = RouterMetrics(self)
        self.policy = SessionHints(cfg.policy, clock)
        self._outbox: asyncio.Queue[Out] = asyncio.Queue(OUTBOX)
        self.store = ResilientStore(
            SessionStore(cfg.redis), cfg.policy.max_sessions, cfg.redis.retry_s
        )
        self._pins = rules.PinQuota(
            cfg.policy.tool_call.max_pins_per_client, cfg.policy.max_sessions, clock
        )
        self.workers: dict[str, Worker] = {}
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        # Each session's last body and its size, for warm-ups only: at most
        # policy.max_sessions bodies and policy.warmup.max_bytes in all.
        self._last_body: OrderedDict[str, tuple[str, dict[str, Any], int, str | None]] = (
            OrderedDict()
        )
        self._last_bytes = 0
        self.app = web.Application(client_max_size=64 << 20)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
                web.get("/v1/models", self._models),
                web.post("/v1/sessions/{sid}/end", self._end_api),
                web.get("/v1/sessions/{sid}", self._session_api),
                web.get("/router/status", self._status),
                web.post("/router/workers/{name}/drain", self._drain_api),
                web.delete("/router/workers/{name}/drain", self._drain_api),
                web.get("/metrics", self._metrics),
                web.get("/health", self._health),
            ]
        )

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.store.ping()
        except StateError as e:  # routing goes on from this replica's memory
            log.warning("%s: starting without session state", e)
        # Idle pooled connections close before the engine's server closes them
        # (uvicorn's keep-alive in vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; aiohttp
        # keeps them 15 s): a turn sent on a connection the server is closing
        # fails with ServerDisconnectedError although the engine is fine.
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.cfg.routing.request_timeout_s),
        )
        for w in self.cfg.workers:
            self.workers[w.name] = Worker(
                w, self.cfg.secret, self._http, self.cfg.routing.load_poll_s, self._final
            )
        await asyncio.gather(*(w.start() for w in self.workers.values()))
        for w in self.workers.values():
            if w.control is not None:
                self._add_engine(w)
        self._spawn(self._sweep_idle())
        self._spawn(self._tick())
        self._spawn(self._send_policy())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers.values()))
        if self._http is not None:
            await self._http.close()
        await self.store.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- outcomes -------------------------------------------------------------------

    def _count(self, worker: str, session_id: str, outcome, via: str) -> None:
        self.counters.outcome(outcome, via)
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

    def _final(self, worker: Worker, outcome) -> None:
        self._count(worker.name, "-", outcome, "final")

    async def _hint(
        self, worker: Worker, action: Action, session_id: str, wait_s: float = 0, **kw: Any
    ):
        """A control hint, counted; with ``wait_s``, its final outcome and transfer
        (None when it did not come in time). Never raises: a failure is logged."""
        try:
            self.counters.sent("control")
            first = await worker.hint(action, session_id, **kw)
        except Exception as e:  # the engine is away: the hint is lost, the turn is not
            log.warning("hint %s on %s for %s failed: %s", action.value, worker.name, session_id, e)
            self.counters.event("hint_errors")
            return None, None
        self._count(worker.name, session_id, first, "control")
        if first.status != "deferred" or not wait_s:
            return first, None
        final = await worker.final(first.hint_id, wait_s)
        if final is None:
            self.counters.event("finals_timed_out")
        return (first, None) if final is None else final

    async def _end_on(self, worker: Worker, session_id: str) -> None:
        try:
            self.counters.sent("control")
            self._count(worker.name, session_id, await worker.end_session(session_id), "control")
        except Exception as e:
            log.warning("end of %s on %s failed: %s", session_id, worker.name, e)
            self.counters.event("hint_errors")

    # ---- the hint policy ---------------------------------------------------------------

    def _policy(self, outs: list[Out]) -> None:
        """Hand the policy's hints to the sender, in order."""
        for o in outs:
            try:
                self._outbox.put_nowait(o)
            except asyncio.QueueFull:
                self.counters.event("policy_hints_dropped")

    def _add_engine(self, w: Worker) -> None:
        """Size the policy for ``w`` from its hello (an old engine's hello
        lacks the sizes: its shadows then model a 1-block G2)."""
        i = w.info
        try:
            g2 = int(i.get("g2_chunks", 0)) * int(i.get("blocks_per_chunk", 1))
            g1, rate = int(i.get("g1_blocks", 0)), float(i.get("hints_per_s", 100.0))
        except (TypeError, ValueError) as e:
            log.warning(
                "worker %s: hello sizes unreadable (%s); policy assumes defaults", w.name, e
            )
            g2, g1, rate = 0, 0, 100.0
        self.policy.add_engine(w.name, g2, g1, rate)

    async def _send_policy(self) -> None:
        while True:
            o = await self._outbox.get()
            worker = self.workers.get(o.worker)
            if worker is None or worker.control is None:
                continue
            try:
                self.counters.sent("policy", len(o.actions))
                outcomes = await worker.hints(o.session, o.actions)
            except Exception as e:  # the engine is away: these hints are lost
                log.warning("policy hints on %s for %s failed: %s", worker.name, o.session, e)
                self.counters.event("hint_errors")
                continue
            for outcome in outcomes:
                self._count(worker.name, o.session, outcome, "policy")
                self.policy.outcome(
                    outcome.action or "?", str(getattr(outcome.status, "value", outcome.status))
                )

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # drains paced hints; re-ranks every policy.tick_s
            try:
                self._policy(self.policy.tick())
            except Exception:  # a bug costs this tick, never the task
                log.exception("policy tick failed")
                self.counters.event("policy_errors")

    async def _prompt_keys(self, worker: Worker, body: dict[str, Any]) -> list[bytes]:
        """The prompt's full-block keys on ``worker``: hashed from a token-id
        prompt, or from the engine's own tokenization of a text or chat
        prompt (its ``/tokenize``: one local round trip, only while a
        strategy that Retains sessions may run); none when that fails."""
        if worker.hasher is None:
            return []
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = prompt
        elif self.cfg.policy.strategy == "plain":
            return []
        else:
            tokens = await worker.tokenize(body)
            self.counters.event("prompts_tokenized" if tokens else "tokenize_failures")
            if not tokens:
                return []
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return worker.hasher.keys(tokens, salt)

    # ---- routing --------------------------------------------------------------------

    def _scores(self, body: dict[str, Any]) -> dict[str, float] | None:
        """Each worker's overlap score for the body's token-id prompt (None
        without one, or with overlap routing off)."""
        prompt = body.get("prompt")
        if (
            not self.cfg.routing.overlap
            or not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        keys: dict[Any, list[bytes]] = {}
        out = {}
        for w in self.workers.values():
            if w.hasher is None or not w.healthy:
                continue
            if w.hasher not in keys:
                keys[w.hasher] = w.hasher.keys(prompt, salt)
            out[w.name] = score(w.index.held(keys[w.hasher]), self.cfg.routing.overlap_g2_weight)
        if any(out.values()):
            self.counters.event("overlap_scored")
        return out

    async def _place(self, session_id: str, body: dict[str, Any]) -> Worker:
        max_load = self.cfg.routing.max_load
        workers = list(self.workers.values())
        state = await self.store.get(session_id)
        if state is None:
            choice = rules.choose(
                workers, None, max_load, await self.store.round_robin(), self._scores(body)
            )
            placed = await self.store.claim(session_id, choice)
            self.counters.event("sessions_new")
            return self.workers.get(placed) or self.workers[choice]
        choice = rules.choose(workers, state.worker, max_load)
        if choice != state.worker:  # it moves: where its prefix is, if anywhere
            choice = rules.choose(
                workers, state.worker, max_load, await self.store.round_robin(), self._scores(body)
            )
        if choice == state.worker or state.worker not in self.workers:
            if state.worker not in self.workers:
                await self.store.move(session_id, state.worker, choice)
            return self.workers[choice]
        if await self.store.move(session_id, state.worker, choice):
            await self._move(session_id, self.workers[state.worker], self.workers[choice])
            return self.workers[choice]
        now = await self.store.get(session_id)  # another replica moved it first
        return self.workers.get(now.worker, self.workers[choice]) if now else self.workers[choice]

    async def _move(self, session_id: str, old: Worker, new: Worker) -> None:
        """Share from ``old`` (and Prefetch on ``new``) per ``policy.on_move``."""
        pol = self.cfg.policy
        self.counters.event("moves")
        log.info(
            "session %s moves %s -> %s (loads %.0f, %.0f)",
            session_id,
            old.name,
            new.name,
            old.load,
            new.load,
        )
        if not old.healthy:
            self.counters.event("failover_moves")
            return
        if pol.on_move == "none":
            return
        _, moved = await self._hint(
            old, Action.SHARE, session_id, pol.move_wait_s, destination=new.name
        )
        if pol.on_move == "share_prefetch" and moved is not None and moved.keys:
            await self._hint(
                new, Action.PREFETCH, session_id, pol.move_wait_s, keys=list(moved.keys)
            )
        await self._end_on(old, session_id)

    # ---- the proxy ------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            try:
                # Bytes, not request.json(): a malformed Content-Type charset
                # raised in aiohttp's parser (a 500, found by bench/fuzz.py).
                body = json.loads(await asyncio.wait_for(request.read(), self.cfg.body_timeout_s))
            except asyncio.TimeoutError:
                raise ValueError(
                    f"the body did not arrive within {self.cfg.body_timeout_s:g} s"
                ) from None
            except RecursionError:
                raise ValueError("the body is nested too deep") from None
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            if not isinstance(body.get("kv_transfer_params") or {}, dict):
                raise ValueError("kv_transfer_params must be a JSON object")
            gap = rules.tool_gap_from_header(
                request.headers.get(rules.TOOL_GAP_HEADER), self.cfg.policy
            )
        except ValueError as e:
            return web.json_response(
                {"error": {"message": str(e), "type": "BadRequest"}}, status=400
            )
        session_id = (
            request.headers.get(SESSION_HEADER) or body.get("session_id") or f"s-{uuid.uuid4().hex}"
        )
        bad = id_problem(session_id, "session_id")
        if bad:  # a NUL could not even be echoed in X-Session-ID
            return web.json_response({"error": {"message": bad, "type": "BadRequest"}}, status=400)
        client = self._client_of(request)
        if await self.store.bind(session_id, client) != client:
            self.counters.event("sessions_refused")
            return web.json_response(
                {
                    "error": {
                        "message": "session_id belongs to another "
                        "client (sessions are bound to the API key "
                        "that started them)",
                        "type": "Forbidden",
                    }
                },
                status=403,
            )
        forward = self._forward_body(body, session_id, gap, client)
        if self.cfg.policy.warmup.enabled:
            self._keep_body(
                session_id,
                request.path,
                forward,
                len(await request.read()),
                request.headers.get("Authorization"),
            )
        await self.store.turn_started(session_id)
        try:
            for _attempt in range(len(self.workers)):
                try:
                    worker = await self._place(session_id, body)
                except rules.NoWorker as e:
                    return web.json_response(
                        {"error": {"message": str(e), "type": "Unavailable"}}, status=503
                    )
                headers = {SESSION_HEADER: session_id, WORKER_HEADER: worker.name}
                self._policy(
                    self.policy.turn_started(
                        session_id, worker.name, await self._prompt_keys(worker, body)
                    )
                )
                headers[ROUTED_HEADER] = f"{time.monotonic() - arrived:.4f}"
                worker.inflight += 1
                try:
                    if body.get("stream"):
                        resp, tool_call = await self._stream(
                            request, worker, forward, headers, arrived
                        )
                    else:
                        resp, tool_call = await self._plain(
                            request, worker, forward, headers, session_id, arrived
                        )
                    self.counters.request(worker.name, resp.status)
                    self.counters.sent(
                        "request", len(forward["kv_transfer_params"][HINTS_PARAM]["actions"])
                    )
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    log.warning("turn of %s on %s failed: %r", session_id, worker.name, e)
                    self.counters.request(worker.name, "error")
                    dead = not isinstance(e, asyncio.TimeoutError) and not await worker.alive()
                    if dead:
                        worker.mark_dead(repr(e))
                    if isinstance(e, _StreamCut):
                        self.counters.event("streams_cut")
                        raise (e.__cause__ or e) from None  # aiohttp drops the client's connection
                    # A connection the server dropped before answering, on a live
                    # worker: sent again there (_place keeps the session on it).
                    again = dead or isinstance(e, aiohttp.ServerDisconnectedError)
                    if not (again and self.cfg.routing.retry):
                        return web.json_response(
                            {
                                "error": {
                                    "message": f"worker {worker.name}: {e!r}",
                                    "type": "BadGateway",
                                }
                            },
                            status=502,
                            headers=headers,
                        )
                    self.counters.event("retries")
                finally:
                    worker.inflight -= 1
            else:
                return web.json_response(
                    {"error": {"message": "every worker failed the turn", "type": "BadGateway"}},
                    status=502,
                )
            if gap is None and tool_call and self.cfg.policy.tool_call.pin:
                gap = self.cfg.policy.tool_call.expected_gap_s
                ttl = rules.pin_ttl(self.cfg.policy, gap)
                if self._may_pin(client, session_id, ttl):
                    await self._hint(worker, Action.PIN, session_id, ttl_s=ttl)
            await self.store.turn_ended(session_id, gap)
            self._policy(self.policy.turn_ended(session_id))
            if gap is not None and self.cfg.policy.warmup.enabled:
                self._spawn(self._warmup(session_id, gap))
            return resp
        except asyncio.CancelledError:
            # The client hung up (handler cancellation): the turn is over for
            # the policy and the store all the same.
            self._policy(self.policy.turn_ended(session_id))
            self._spawn(self.store.turn_ended(session_id, None))
            raise

    def _keep_body(
        self, session_id: str, path: str, body: dict[str, Any], size: int, auth: str | None
    ) -> None:
        """Keep the session's last body (``size``: its request's bytes) and
        the client's ``Authorization`` for its warm-up, least recent out past
        ``policy.max_sessions`` bodies or ``policy.warmup.max_bytes``."""
        self._drop_body(session_id)
        if size > self.cfg.policy.warmup.max_bytes:
            return
        self._last_body[session_id] = (path, body, size, auth)
        self._last_bytes += size
        while (
            len(self._last_body) > self.cfg.policy.max_sessions
            or self._last_bytes > self.cfg.policy.warmup.max_bytes
        ):
            self._drop_body(next(iter(self._last_body)))

    def _drop_body(self, session_id: str) -> None:
        kept = self._last_body.pop(session_id, None)
        if kept is not None:
            self._last_bytes -= kept[2]

    def _client_of(self, request: web.Request) -> str:
        """Who sends a turn: a name for its API key (``Authorization: Bearer``,
        as OpenAI clients send it; the key itself is never stored), "" for
        clients without one (their sessions are shared among them)."""
        token = _bearer(request)
        if not token:
            return ""
        name = hmac.new(
            derive(self.cfg.secret, ROUTER_CLIENT), token.encode("utf-8", "replace"), hashlib.sha256
        )
        return "k-" + name.hexdigest()[:32]

    def _may_pin(self, client: str, session_id: str, ttl_s: float) -> bool:
        """Whether the client's Pin quota (``tool_call.max_pins_per_client``)
        takes a Pin of this session."""
        if self._pins.take(client, session_id, ttl_s):
            return True
        self.counters.event("pins_over_quota")
        return False

    def _forward_body(
        self, body: dict[str, Any], session_id: str, gap: float | None, client: str
    ) -> dict[str, Any]:
        params = {
            k: v
            for k, v in (body.get("kv_transfer_params") or {}).items()
            if k not in (HINTS_PARAM, SIG_PARAM, KVCR_PARAM)
        }
        actions = []
        if gap is not None and self.cfg.policy.tool_call.pin:
            ttl = rules.pin_ttl(self.cfg.policy, gap)
            if self._may_pin(client, session_id, ttl):
                actions.append(hint_action(Action.PIN, ttl_s=ttl))
        # Every turn is signed, hints or not: engines give per-tier counts in
        # their reports only to signed requests (report.per_tier: signed).
        env = envelope(*actions)
        params[HINTS_PARAM] = env
        params[SIG_PARAM] = sign(env, session_id, self.cfg.secret)
        return {**body, "session_id": session_id, "kv_transfer_params": params}

    @staticmethod
    def _upstream_headers(request: web.Request, session_id: str) -> dict[str, str]:
        """What a turn sends the engine: the session, and the client's
        ``Authorization`` (so engines can run vLLM's ``--api-key``)."""
        return {SESSION_HEADER: session_id, **_client_auth(request)}

    async def _plain(self, request, worker, body, headers, session_id, arrived):
        async with self._http.post(
            worker.url + request.path,
            json=body,
            headers=self._upstream_headers(request, session_id),
        ) as r:
            raw = await r.read()
            ctype = r.headers.get("Content-Type", "application/json")
            status = r.status
        self.metrics.ttft(worker.name, time.monotonic() - arrived)  # the whole answer
        tool_call = False
        if status == 200:
            with contextlib.suppress(ValueError):
                doc = json.loads(raw)
                tool_call = rules.ends_in_tool_call(doc)
                self._reported(worker, session_id, doc.get("kv_transfer_params"))
        resp = web.Response(body=raw, status=status, headers=headers)
        resp.content_type = ctype.split(";")[0]
        return resp, tool_call

    def _reported(self, worker: Worker, session_id: str, params: Any) -> None:
        try:
            report = RequestReport.from_params(params)
        except Exception:
            report = None
        if report is None:
            return
        self.counters.report(report)
        for o in report.hints:
            self._count(worker.name, session_id, o, "request")

    async def _stream(self, request, worker, body, headers, arrived):
        resp = web.StreamResponse(headers=headers)
        tool_call, first = False, True
        async with self._http.post(
            worker.url + request.path,
            json=body,
            headers=self._upstream_headers(request, headers[SESSION_HEADER]),
        ) as r:
            resp.set_status(r.status)
            for k, v in r.headers.items():
                if k.lower() not in HOP_HEADERS:
                    resp.headers.setdefault(k, v)
            await resp.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    tool_call = tool_call or b'"finish_reason":"tool_calls"' in chunk.replace(
                        b" ", b""
                    )
                    await resp.write(chunk)
                    if first:
                        self.metrics.ttft(worker.name, time.monotonic() - arrived)
                        first = False
            except aiohttp.ClientError as e:
                raise _StreamCut(str(e)) from e
        await resp.write_eof()
        return resp, tool_call

    async def _warmup(self, session_id: str, gap_s: float) -> None:
        """A one-token replay of the session's last prompt, ``lead_s`` before
        its tool gap's expected end, unless a turn came first."""
        before = await self.store.get(session_id)
        await asyncio.sleep(max(0.0, gap_s - self.cfg.policy.warmup.lead_s))
        state = await self.store.get(session_id)
        if state is None or before is None or state.turns != before.turns:
            return
        path, body, _, auth = self._last_body.get(session_id, (None, None, 0, None))
        if body is None:
            return
        warm = {**body, "max_tokens": 1, "stream": False}
        # Signed, with no hint: engines close router sessions to unsigned turns.
        env = envelope()
        warm["kv_transfer_params"] = {
            **{
                k: v
                for k, v in (body.get("kv_transfer_params") or {}).items()
                if k not in (HINTS_PARAM, SIG_PARAM)
            },
            HINTS_PARAM: env,
            SIG_PARAM: sign(env, session_id, self.cfg.secret),
        }
        worker = self.workers[state.worker]
        try:
            async with self._http.post(
                worker.url + path,
                json=warm,
                headers={SESSION_HEADER: session_id, **({"Authorization": auth} if auth else {})},
            ) as r:
                await r.read()
            if r.status != 200:
                log.warning("warm-up of %s on %s: HTTP %d", session_id, worker.name, r.status)
                return
            self.counters.event("warmups")
        except aiohttp.ClientError as e:
            log.warning("warm-up of %s on %s failed: %s", session_id, worker.name, e)

    # ---- session ends ----------------------------------------------------------------

    async def end_session(self, session_id: str, reason: str) -> str | None:
        """End a session (``policy.on_end``); the worker it was on, or None
        when it was unknown or another replica ended it."""
        state = await self.store.end(session_id)
        self._drop_body(session_id)
        if state is None:
            return None
        self.counters.event(f"ended_{reason}")
        worker = self.workers.get(state.worker)
        if worker is not None and self.cfg.policy.on_end == "demote":
            await self._hint(worker, Action.DEMOTE, session_id)
        outs = self.policy.session_ended(session_id)
        ends = [o for o in outs if isinstance(o, End)]
        if not ends and worker is not None:
            ends = [End(worker.name, session_id)]  # its turns went through another replica
        if self.cfg.policy.on_end != "none":
            for o in ends:  # ended when this returns
                if o.worker in self.workers:
                    await self._end_on(self.workers[o.worker], session_id)
        self._policy([o for o in outs if not isinstance(o, End)])
        return state.worker

    async def _sweep_idle(self) -> None:
        idle_s = self.cfg.policy.idle_timeout_s
        while True:
            await asyncio.sleep(min(5.0, idle_s / 4))
            try:
                for session_id in await self.store.idle(idle_s):
                    await self.end_session(session_id, "idle")
            except Exception as e:
                log.warning("idle sweep: %s", e)

    # ---- small endpoints ---------------------------------------------------------------

    async def _mine(self, request: web.Request) -> bool:
        """Whether the session named in the path is the caller's: another
        client's session answers as unknown (its existence is not told)."""
        return await self.store.owner(request.match_info["sid"]) == self._client_of(request)

    async def _end_api(self, request: web.Request) -> web.Response:
        # Shielded: a client that hangs up must not leave the end half done.
        worker = (
            await asyncio.shield(self.end_session(request.match_info["sid"], "api"))
            if await self._mine(request)
            else None
        )
        if worker is None:
            return web.json_response({"error": {"message": "unknown session"}}, status=404)
        return web.json_response({"ended": True, "worker": worker})

    async def _session_api(self, request: web.Request) -> web.Response:
        state = (
            await self.store.get(request.match_info["sid"]) if await self._mine(request) else None
        )
        if state is None:
            return web.json_response({"error": {"message": "unknown session"}}, status=404)
        return web.json_response(state.__dict__)

    async def _models(self, request: web.Request) -> web.Response:
        worker = next((w for w in self.workers.values() if w.healthy), None)
        if worker is None:
            return web.json_response({"error": {"message": "no healthy worker"}}, status=503)
        async with self._http.get(worker.url + "/v1/models", headers=_client_auth(request)) as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    def _admin(self, request: web.Request) -> bool:
        """Whether the request carries the admin token (``admin_token``)."""
        return hmac.compare_digest(
            _bearer(request).encode("utf-8", "replace"), admin_token(self.cfg.secret).encode()
        )

    async def _drain_api(self, request: web.Request) -> web.Response:
        """``POST /router/workers/{name}/drain``: before an engine is stopped,
        it takes no more turns while another worker can, and every session
        this router last sent there is Demoted to G3 now (their next turns
        move, Share what is left, and load instead of recomputing); the
        Demotes' outcomes by status. ``DELETE``: it takes turns again."""
        if not self._admin(request):
            return web.json_response(
                {
                    "error": {
                        "message": "an admin route: send "
                        "Authorization: Bearer <sessionkv router "
                        "--admin-token>",
                        "type": "Unauthorized",
                    }
                },
                status=401,
            )
        worker = self.workers.get(request.match_info["name"])
        if worker is None:
            return web.json_response({"error": {"message": "unknown worker"}}, status=404)
        worker.draining = request.method == "POST"
        if not worker.draining:
            return web.json_response({"worker": worker.name, "draining": False})
        self.counters.event("drains")
        sessions = self.policy.sessions_on(worker.name)
        log.info("draining worker %s: demoting %d sessions", worker.name, len(sessions))
        gate = asyncio.Semaphore(DRAIN_CONCURRENCY)

        async def demote(sid: str) -> str:
            async with gate:
                first, _ = await self._hint(worker, Action.DEMOTE, sid, self.cfg.policy.move_wait_s)
            return "error" if first is None else str(getattr(first.status, "value", first.status))

        outcomes = Counter(await asyncio.gather(*(demote(s) for s in sessions)))
        return web.json_response(
            {
                "worker": worker.name,
                "draining": True,
                "sessions": len(sessions),
                "demoted": dict(outcomes),
            }
        )

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "workers": [w.status() for w in self.workers.values()],
                **self.counters.to_dict(),
                "policy": self.policy.status(),
                "state": self.store.status(),
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body, ctype = self.metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = ctype
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        """503 without a healthy worker; 200 while Redis fails (turns are
        routed from memory), and then ``state_store`` says so."""
        ok = any(w.healthy for w in self.workers.values())
        return web.json_response(
            {"ok": ok, "state_store": "ok" if self.store.usable() else "unreachable"},
            status=200 if ok else 503,
        )


def _bearer(request: web.Request) -> str:
    """The token of the request's ``Authorization: Bearer``, "" without one."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def _client_auth(request: web.Request) -> dict[str, str]:
    """The client's ``Authorization`` header, to forward to an engine."""
    auth = request.headers.get("Authorization")
    return {} if auth is None else {"Authorization": auth}


def admin_token(secret: bytes) -> str:
    """The bearer token of the router's admin routes (drain): derived from
    the cluster secret (``keys.ROUTER_ADMIN``), so only its holders have it."""
    return derive(secret, ROUTER_ADMIN).hex()


async def serve(cfg: RouterConfig, ready=None) -> None:
    """Run the router until SIGINT or SIGTERM; ``ready(port)`` once it listens."""
    router = Router(cfg)
    await router.start()
    # A client that hangs up cancels its turn's handler, which closes the
    # engine's connection: vLLM aborts the request (non-streamed ones ran on).
    # aiohttp's keep-alive deadline runs from the connection's start and from
    # each response, and closes a connection still waiting for a whole request
    # head at it: the header timeout (its default, 3,630 s, held every
    # half-sent request). Never while a handler runs. 75 s, as nginx's
    # keep-alive: proxies in front (nginx, ALB: 60 s) idle out first.
    runner = web.AppRunner(
        router.app,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=cfg.header_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info(
        "sessionkv router on http://%s:%d, workers %s", cfg.host, port, ", ".join(router.workers)
    )
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await router.close()
