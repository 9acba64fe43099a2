"""A failed turn moves its session only when the worker is dead: a worker that
drops one connection before answering (what a pooled connection closed by the
server's keep-alive produces) or answers ``/health`` slowly once keeps the
session. The engine is a stand-in (an aiohttp server on loopback that drops a
connection or stalls on cue: a real vLLM server cannot be made to on cue);
the router is the real one, in this process."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from sessionkv.devtools.server import free_port
from sessionkv.router.app import Router
from sessionkv.router.config import WorkerConfig, parse_config
from sessionkv.router.workers import Worker


async def stand_in(script, load=0):
    """A server whose n-th ``/v1/completions`` does ``script[n]``: "drop"
    (close the connection unanswered) or "ok"; (runner, url, calls)."""
    calls = []

    async def completions(request):
        step = script[len(calls)] if len(calls) < len(script) else "ok"
        calls.append(step)
        if step == "drop":
            request.transport.close()
            await asyncio.sleep(1)
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)

    async def health(_request):
        return web.Response()

    async def metrics(_request):
        return web.Response(text=f"vllm:num_requests_running {load}\n")

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", calls


def test_a_dropped_connection_on_a_live_worker_is_sent_again_there(tmp_path):
    (tmp_path / "key").write_bytes(b"k" * 32)

    async def go():
        a, url_a, calls_a = await stand_in(["drop"])
        b, url_b, calls_b = await stand_in([], load=2)  # busier: s goes to a
        cfg = parse_config(
            {
                "secret_file": str(tmp_path / "key"),
                "redis": {"url": f"redis://127.0.0.1:{free_port()}/0"},  # down: memory only
                "workers": [
                    {"name": "a", "url": url_a, "plain": True},
                    {"name": "b", "url": url_b, "plain": True},
                ],
                "routing": {"load_poll_s": 0.1, "overlap": False},
            }
        )
        router = Router(cfg)
        await router.start()
        await asyncio.sleep(0.3)  # a load poll of each
        runner = web.AppRunner(router.app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as http:
                placed = []
                for _ in range(2):
                    async with http.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": "m", "prompt": "hi"},
                        headers={"X-Session-ID": "s"},
                    ) as r:
                        assert r.status == 200, await r.text()
                        placed.append(r.headers["X-SessionKV-Worker"])
            return placed, calls_a, calls_b, {n: w.healthy for n, w in router.workers.items()}
        finally:
            await runner.cleanup()
            await router.close()
            await a.cleanup()
            await b.cleanup()

    placed, calls_a, calls_b, healthy = asyncio.run(go())
    # both turns on one worker; a's first call dropped, then it answered
    assert placed == ["a", "a"], (placed, calls_a, calls_b)
    assert calls_a == ["drop", "ok", "ok"] and calls_b == []
    assert healthy == {"a": True, "b": True}


@pytest.mark.parametrize("stall", [True, False])
def test_one_slow_health_answer_is_not_death(stall):
    answers = []

    async def health(_request):
        answers.append(len(answers))
        if stall and len(answers) == 1:
            await asyncio.sleep(1.0)
        return web.Response()

    async def go():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as http:
                w = Worker(
                    WorkerConfig(name="a", url=f"http://127.0.0.1:{port}"),
                    b"s" * 16,
                    http=http,
                    load_poll_s=1.0,
                )
                live = await w.alive(timeout_s=0.3)
                gone = Worker(
                    WorkerConfig(name="b", url=f"http://127.0.0.1:{free_port()}"),
                    b"s" * 16,
                    http=http,
                    load_poll_s=1.0,
                )
                return live, await gone.alive(timeout_s=0.3)
        finally:
            await runner.cleanup()

    live, dead = asyncio.run(go())
    assert live and not dead
    assert len(answers) == (2 if stall else 1)
