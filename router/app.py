"""The reference router: an OpenAI-compatible async reverse proxy in front of
several vLLM engines running ``SessionTierConnector``.

    sessionkv router --config router.yaml

Each turn (``POST /v1/completions`` or ``/v1/chat/completions``, streaming or
not) belongs to a session: the ``X-Session-ID`` header or the body's
``session_id``, else one the router makes (unguessable) and returns in
``X-Session-ID``. A session id belongs to the client (API key, ``auth.py``)
whose turn named it first: another client's turns in it get 403, its
endpoints 404 (``endpoints.py``), and router Pins count against each
client's quota. The turn goes where ``routing.choose`` says (affinity, then
KV overlap, then load; state in Redis), with the body's ``session_id`` set
and the router's own hints, signed, in ``kv_transfer_params`` (a client's
own ``kv_hints`` are dropped: only the router signs). Responses pass
through unchanged, with ``X-SessionKV-Worker`` naming the worker.

Hints: what to hint and when is the planner's (``hinting.HintPlanner``,
``policy`` in router.yaml); this module tells it each lifecycle event as it
happens (a turn's arrival, placement, move, response, end; a session's
end; a tick every second) and carries out what it returns: hints on the
request, control hints and ends awaited, paced Retains to the sender
(``transport.HintTransport``), warm-up requests.

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
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from sessionkv.hints import (
    HINTS_PARAM,
    KVCR_PARAM,
    SIG_PARAM,
    envelope,
    id_problem,
    sign,
)
from sessionkv.report import RequestReport
from sessionkv.router.auth import client_auth, client_of
from sessionkv.router.bodies import LastBodies
from sessionkv.router.config import RouterConfig
from sessionkv.router.endpoints import Endpoints
from sessionkv.router.hinting import (
    TOOL_GAP_HEADER,
    End,
    HintPlanner,
    Send,
    Warmup,
    chunk_ends_in_tool_call,
    ends_in_tool_call,
)
from sessionkv.router.metrics import Counters, RouterMetrics
from sessionkv.router.routing import NoWorker, cache_salt, choose, overlap_scores, token_ids
from sessionkv.router.state import ResilientStore, SessionStore, StateError
from sessionkv.router.transport import HintTransport
from sessionkv.router.workers import Worker

log = logging.getLogger("sessionkv.router")
SESSION_HEADER = "X-Session-ID"
WORKER_HEADER = "X-SessionKV-Worker"
# Seconds from the turn's arrival to its forwarding: session state, placement,
# a move's Share wait, the policy's work (benches attribute TTFT with it).
ROUTED_HEADER = "X-SessionKV-Routed-S"
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

    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.counters = Counters()
        self.metrics = RouterMetrics(self)
        self.planner = HintPlanner(cfg.policy, clock)
        self.store = ResilientStore(
            SessionStore(cfg.redis), cfg.policy.max_sessions, cfg.redis.retry_s
        )
        self.workers: dict[str, Worker] = {}
        self.transport = HintTransport(self.workers, self.counters, self.planner)
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        # for warm-ups only (kept while policy.warmup.enabled)
        self._bodies = LastBodies(cfg.policy.max_sessions, cfg.policy.warmup.max_bytes)
        own = Endpoints(self)
        self.app = web.Application(client_max_size=64 << 20)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
                web.get("/v1/models", own.models),
                web.post("/v1/sessions/{sid}/end", own.end),
                web.get("/v1/sessions/{sid}", own.session),
                web.get("/router/status", own.status),
                web.post("/router/workers/{name}/drain", own.drain),
                web.delete("/router/workers/{name}/drain", own.drain),
                web.get("/metrics", own.metrics),
                web.get("/health", own.health),
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
        for wc in self.cfg.workers:
            self.workers[wc.name] = Worker(
                wc, self.cfg.secret, self._http, self.cfg.routing.load_poll_s, self.transport.final
            )
        await asyncio.gather(*(w.start() for w in self.workers.values()))
        for w in self.workers.values():
            if w.control is not None:
                self._add_engine(w)
        self._spawn(self._sweep_idle())
        self._spawn(self._tick())
        self._spawn(self.transport.run())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers.values()))
        if self._http is not None:
            await self._http.close()
        await self.store.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        """The client session to the engines (from ``start`` on)."""
        if self._http is None:
            raise RuntimeError("the router is not started")
        return self._http

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- the planner's engines and ticks --------------------------------------------

    def _add_engine(self, w: Worker) -> None:
        """Size the planner for ``w`` from its hello."""
        problem = self.planner.add_engine_hello(w.name, w.info)
        if problem is not None:
            log.warning(
                "worker %s: hello sizes unreadable (%s); policy assumes defaults", w.name, problem
            )

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # drains paced hints; re-ranks every policy.tick_s
            try:
                self.transport.queue(self.planner.tick())
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
        tokens = token_ids(body)
        if tokens is None:
            if not self.planner.tokenizes_text:
                return []
            tokens = await worker.tokenize(body)
            self.counters.event("prompts_tokenized" if tokens else "tokenize_failures")
            if not tokens:
                return []
        return worker.hasher.keys(tokens, cache_salt(body))

    # ---- routing --------------------------------------------------------------------

    def _scores(self, body: dict[str, Any]) -> dict[str, float] | None:
        """Each worker's overlap score for the body's token-id prompt (None
        without one, or with overlap routing off)."""
        tokens = token_ids(body)
        if not self.cfg.routing.overlap or tokens is None:
            return None
        out = overlap_scores(
            list(self.workers.values()),
            tokens,
            cache_salt(body),
            self.cfg.routing.overlap_g2_weight,
        )
        if any(out.values()):
            self.counters.event("overlap_scored")
        return out

    async def _place(self, session_id: str, body: dict[str, Any]) -> Worker:
        max_load = self.cfg.routing.max_load
        workers = list(self.workers.values())
        state = await self.store.get(session_id)
        if state is None:
            choice = choose(
                workers, None, max_load, await self.store.round_robin(), self._scores(body)
            )
            placed = await self.store.claim(session_id, choice)
            self.counters.event("sessions_new")
            return self.workers.get(placed) or self.workers[choice]
        choice = choose(workers, state.worker, max_load)
        if choice != state.worker:  # it moves: where its prefix is, if anywhere
            choice = choose(
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
        """Send what the planner's move says (Share, Prefetch, the old end)."""
        self.counters.event("moves")
        log.info(
            "session %s moves %s -> %s (loads %.0f, %.0f)",
            session_id,
            old.name,
            new.name,
            old.load,
            new.load,
        )
        move = self.planner.move(session_id, old.name, new.name, old.healthy)
        if move.failover:
            self.counters.event("failover_moves")
        if move.share is not None:
            _, moved = await self.transport.hint(move.share)
            prefetch = move.prefetch(moved)
            if prefetch is not None:
                await self.transport.hint(prefetch)
        if move.end is not None:
            await self.transport.end(move.end)

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
            gap = self.planner.tool_gap(request.headers.get(TOOL_GAP_HEADER))
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
        client = client_of(self.cfg.secret, request)
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
        if self.planner.keeps_bodies:
            self._bodies.keep(
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
                except NoWorker as e:
                    return web.json_response(
                        {"error": {"message": str(e), "type": "Unavailable"}}, status=503
                    )
                headers = {SESSION_HEADER: session_id, WORKER_HEADER: worker.name}
                self.transport.queue(
                    self.planner.turn_started(
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
            end = self.planner.turn_answered(session_id, worker.name, client, gap, tool_call)
            if end.over_quota:
                self.counters.event("pins_over_quota")
            for h in end.hints:
                await self.transport.hint(h)
            await self.store.turn_ended(session_id, end.gap_s)
            self.transport.queue(self.planner.turn_ended(session_id))
            if end.warmup is not None:
                self._spawn(self._warmup(end.warmup))
            return resp
        except asyncio.CancelledError:
            # The client hung up (handler cancellation): the turn is over for
            # the planner and the store all the same.
            self.transport.queue(self.planner.turn_ended(session_id))
            self._spawn(self.store.turn_ended(session_id, None))
            raise

    def _forward_body(
        self, body: dict[str, Any], session_id: str, gap: float | None, client: str
    ) -> dict[str, Any]:
        params = {
            k: v
            for k, v in (body.get("kv_transfer_params") or {}).items()
            if k not in (HINTS_PARAM, SIG_PARAM, KVCR_PARAM)
        }
        hints = self.planner.request_hints(session_id, client, gap)
        if hints.over_quota:
            self.counters.event("pins_over_quota")
        # Every turn is signed, hints or not: engines give per-tier counts in
        # their reports only to signed requests (report.per_tier: signed).
        env = envelope(*hints.actions)
        params[HINTS_PARAM] = env
        params[SIG_PARAM] = sign(env, session_id, self.cfg.secret)
        return {**body, "session_id": session_id, "kv_transfer_params": params}

    @staticmethod
    def _upstream_headers(request: web.Request, session_id: str) -> dict[str, str]:
        """What a turn sends the engine: the session, and the client's
        ``Authorization`` (so engines can run vLLM's ``--api-key``)."""
        return {SESSION_HEADER: session_id, **client_auth(request)}

    async def _plain(self, request, worker, body, headers, session_id, arrived):
        async with self.http.post(
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
                tool_call = ends_in_tool_call(doc)
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
            self.transport.count(worker.name, session_id, o, "request")

    async def _stream(self, request, worker, body, headers, arrived):
        resp = web.StreamResponse(headers=headers)
        tool_call, first = False, True
        async with self.http.post(
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
                    tool_call = tool_call or chunk_ends_in_tool_call(chunk)
                    await resp.write(chunk)
                    if first:
                        self.metrics.ttft(worker.name, time.monotonic() - arrived)
                        first = False
            except aiohttp.ClientError as e:
                raise _StreamCut(str(e)) from e
        await resp.write_eof()
        return resp, tool_call

    async def _warmup(self, plan: Warmup) -> None:
        """The planner's warm-up: the session's last body replayed after
        ``plan.delay_s``, unless a turn of it came first."""
        session_id = plan.session
        before = await self.store.get(session_id)
        await asyncio.sleep(plan.delay_s)
        state = await self.store.get(session_id)
        if state is None or before is None or state.turns != before.turns:
            return
        kept = self._bodies.get(session_id)
        if kept is None:
            return
        path, body, auth = kept.path, kept.body, kept.auth
        warm = self.planner.warmup_body(body)
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
            async with self.http.post(
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
        self._bodies.drop(session_id)
        if state is None:
            return None
        self.counters.event(f"ended_{reason}")
        worker = state.worker if state.worker in self.workers else None
        for h in self.planner.session_ending(session_id, worker):
            await self.transport.hint(h)
        outs = self.planner.session_ended(session_id, worker)
        for o in outs:  # ended when this returns
            if isinstance(o, End) and o.worker in self.workers:
                await self.transport.end(o)
        self.transport.queue([o for o in outs if isinstance(o, Send)])
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
