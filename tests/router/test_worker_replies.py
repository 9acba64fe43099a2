"""The router reads engines' replies defensively: a bad ``/metrics`` sample,
a bad ``probe`` answer or an event kind it does not know degrades that
worker (with the reason) and never kills a task or the router's start."""

import asyncio

import aiohttp
import pytest

from sessionkv.client import EventPage
from sessionkv.events import Residency
from sessionkv.router.config import WorkerConfig
from sessionkv.router.overlap import PROBE_TOKENS, BlockHasher, ProbeMismatch
from sessionkv.router.workers import Worker, _metric_sum


def test_metric_samples_without_a_value_are_skipped_and_counted():
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running running",
            'vllm:num_requests_running{model="a b",engine="0"} 3.0',
            "vllm:num_requests_running{x}",  # no value: was an IndexError
            'vllm:num_requests_running{engine="1"} 2 1700000000000',  # with a timestamp
            "vllm:num_requests_running NaN",
            "vllm:num_requests_running -1.7e308",  # negative (fuzz: two made -inf)
            "vllm:num_requests_running 1.7e308",
            "vllm:num_requests_running_total 99",  # another metric
        ]
    )
    assert _metric_sum(text, "vllm:num_requests_running") == (5.0, 4)


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 0},
        {"block_size": True},
        {"block_size": "32"},
        {"block_size": 1 << 40},
        {"hash_algo": ["sha256"]},
        {"block_hashes": "ab"},
        {"block_hashes": [1, 2]},
    ],
)
def test_bad_probe_answers_are_mismatches(change):
    answer = {
        "block_size": 32,
        "hash_algo": "sha256",
        "hash_root": "00" * 32,
        "block_hashes": ["00"],
        **change,
    }
    with pytest.raises(ProbeMismatch):
        BlockHasher.from_probe(answer, PROBE_TOKENS)


class NewerEngine:
    """Fake control client (a newer engine, which this build cannot run): its
    event pages hold kinds this router skips, so ``last_seq`` runs past the
    events it decoded."""

    def __init__(self):
        self.calls = []

    async def events(self, after, limit):
        self.calls.append(after)
        if after < 10:  # seqs 1..10: only 4 decoded, the rest of unknown kinds
            known = [Residency(seq=s, tier="G2", keys=[b"k%d" % s]) for s in (2, 3, 5, 7)]
            return EventPage((known, 1, 21, 10))
        if after < 20:  # seqs 11..20: none known
            return EventPage(([], 1, 21, 20))
        return EventPage(([], 1, 21, 0))


def test_the_follower_steps_past_event_kinds_it_does_not_know():
    async def go():
        w = Worker(
            WorkerConfig(name="a", url="http://127.0.0.1:1", control="tcp://x:1"),
            b"s" * 16,
            http=None,
            load_poll_s=1.0,
        )
        w.control = NewerEngine()
        task = asyncio.create_task(w._follow(w.control))
        w._wake.set()
        await asyncio.sleep(0.3)
        alive = not task.done()
        task.cancel()
        return w, alive

    w, alive = asyncio.run(go())
    assert alive and w._seq == 20
    assert w.control.calls[:2] == [0, 10]  # one read per page, no re-reading


def test_a_worker_turns_unhealthy_only_after_several_failed_polls():
    """A stand-in engine (an aiohttp server on loopback whose ``/metrics``
    fails on cue: a saturated engine's slow reply cannot be produced on cue
    with a real one) answers, fails twice, answers, then fails for good."""
    from aiohttp import web

    from sessionkv.devtools.server import free_port
    from sessionkv.router.workers import FAILED_POLLS_UNHEALTHY

    script = ["ok", "fail", "fail", "ok"] + ["fail"] * FAILED_POLLS_UNHEALTHY
    seen = []

    async def metrics(_request):
        step = script[len(seen)] if len(seen) < len(script) else "fail"
        seen.append(step)
        if step == "fail":
            return web.Response(status=503)
        return web.Response(text="vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n")

    async def go():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        health = []
        async with aiohttp.ClientSession() as http:
            w = Worker(
                WorkerConfig(name="a", url=f"http://127.0.0.1:{port}", control="tcp://x:1"),
                b"s" * 16,
                http=http,
                load_poll_s=0.02,
            )
            task = asyncio.create_task(w._poll_load())
            while len(seen) < len(script):
                health.append((len(seen), w.healthy))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            task.cancel()
            final = (w.healthy, w.load)
        await runner.cleanup()
        return health, final

    health, (healthy, load) = asyncio.run(go())
    # healthy from the first answer through the two failures and the next answer
    assert all(h for n, h in health if 1 <= n <= 4), health
    assert not healthy and load == 3.0
