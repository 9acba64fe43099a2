"""The router's own HTTP endpoints, beside the proxied turns (``app.py``):

- ``GET /v1/models``: the first healthy worker's answer;
- ``POST /v1/sessions/{id}/end`` and ``GET /v1/sessions/{id}``: a session's
  end and state, for its owner only (anyone else gets 404: its existence
  is not told);
- ``POST``/``DELETE /router/workers/{name}/drain``: with the admin token
  (``auth.admin_token``), a worker takes no more turns while another can,
  and the planner's Demotes of its sessions are sent (``DRAIN_CONCURRENCY``
  at a time); ``DELETE`` ends the drain;
- ``GET /router/status`` (JSON), ``GET /metrics`` (Prometheus, the same
  counters), ``GET /health``.

Threading: the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

from aiohttp import web

from sessionkv.router.auth import client_auth, client_of, is_admin
from sessionkv.router.hinting import Hint

if TYPE_CHECKING:
    from sessionkv.router.app import Router

log = logging.getLogger("sessionkv.router")
DRAIN_CONCURRENCY = 8  # Demotes in flight at once while a worker drains


class Endpoints:
    """The handlers of one ``Router``'s own endpoints (see the module docstring)."""

    def __init__(self, router: Router):
        self._r = router

    async def _mine(self, request: web.Request) -> bool:
        """Whether the session named in the path is the caller's: another
        client's session answers as unknown (its existence is not told)."""
        r = self._r
        return await r.store.owner(request.match_info["sid"]) == client_of(r.cfg.secret, request)

    async def end(self, request: web.Request) -> web.Response:
        # Shielded: a client that hangs up must not leave the end half done.
        worker = (
            await asyncio.shield(self._r.end_session(request.match_info["sid"], "api"))
            if await self._mine(request)
            else None
        )
        if worker is None:
            return web.json_response({"error": {"message": "unknown session"}}, status=404)
        return web.json_response({"ended": True, "worker": worker})

    async def session(self, request: web.Request) -> web.Response:
        state = (
            await self._r.store.get(request.match_info["sid"])
            if await self._mine(request)
            else None
        )
        if state is None:
            return web.json_response({"error": {"message": "unknown session"}}, status=404)
        return web.json_response(state.__dict__)

    async def models(self, request: web.Request) -> web.Response:
        worker = next((w for w in self._r.workers.values() if w.healthy), None)
        if worker is None:
            return web.json_response({"error": {"message": "no healthy worker"}}, status=503)
        async with self._r.http.get(
            worker.url + "/v1/models", headers=client_auth(request)
        ) as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type="application/json"
            )

    async def drain(self, request: web.Request) -> web.Response:
        """``POST /router/workers/{name}/drain``: before an engine is stopped,
        it takes no more turns while another worker can, and every session
        this router last sent there is Demoted to G3 now (their next turns
        move, Share what is left, and load instead of recomputing); the
        Demotes' outcomes by status. ``DELETE``: it takes turns again."""
        r = self._r
        if not is_admin(r.cfg.secret, request):
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
        worker = r.workers.get(request.match_info["name"])
        if worker is None:
            return web.json_response({"error": {"message": "unknown worker"}}, status=404)
        worker.draining = request.method == "POST"
        if not worker.draining:
            return web.json_response({"worker": worker.name, "draining": False})
        r.counters.event("drains")
        demotes = r.planner.drain(worker.name)
        log.info("draining worker %s: demoting %d sessions", worker.name, len(demotes))
        gate = asyncio.Semaphore(DRAIN_CONCURRENCY)

        async def demote(h: Hint) -> str:
            async with gate:
                first, _ = await r.transport.hint(h)
            return "error" if first is None else str(getattr(first.status, "value", first.status))

        outcomes = Counter(await asyncio.gather(*(demote(h) for h in demotes)))
        return web.json_response(
            {
                "worker": worker.name,
                "draining": True,
                "sessions": len(demotes),
                "demoted": dict(outcomes),
            }
        )

    async def status(self, request: web.Request) -> web.Response:
        r = self._r
        return web.json_response(
            {
                "workers": [w.status() for w in r.workers.values()],
                **r.counters.to_dict(),
                "policy": r.planner.status(),
                "state": r.store.status(),
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        body, ctype = self._r.metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = ctype
        return resp

    async def health(self, request: web.Request) -> web.Response:
        """503 without a healthy worker; 200 while Redis fails (turns are
        routed from memory), and then ``state_store`` says so."""
        r = self._r
        ok = any(w.healthy for w in r.workers.values())
        return web.json_response(
            {"ok": ok, "state_store": "ok" if r.store.usable() else "unreachable"},
            status=200 if ok else 503,
        )
