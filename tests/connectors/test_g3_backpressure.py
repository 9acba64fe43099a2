"""Issue 52, "Defaults that amplify traffic": G3 write-through had no
backpressure, so a G3 tier slower than the engine's stores queued every
cascade, each holding its G2 slots, ahead of every G3 load, until G2 took no
new chunk. By default each G3 tier now drops cascades while it carries a
backlog of an eighth of G2, at least one backend call
(``tiers/g3/backpressure.py``); a user's own ``backpressure`` wins; the queue
and the drops are on vLLM's own metrics.

Real parts: vLLM's ``Scheduler`` with ``SessionTierConnector`` built from
``--kv-transfer-config`` (no model: ``bench/scale_steps.py``; its chunks are
4 KiB), a real Redis G3 tier, and a real stall: Redis's ``CLIENT PAUSE
WRITE`` holds every put."""

import time

import pytest
import redis
import scale_steps as steps
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
from vllm.v1.request import Request

from sessionkv.connectors.spec import SessionTierSpec
from sessionkv.connectors.vllm import SessionTierConnector
from sessionkv.tiers.g3.backpressure import CascadeQueue, default_max_chunks
from sessionkv.tiers.g3.tier import BATCH_BYTES
from sessionkv.types import Tier

TIER = ("1:RedisTier",)  # vLLM's tier label
ACTIVE = "vllm:kv_offload_tiering_active_cascade_jobs"
READ_USAGE = "vllm:kv_offload_tiering_primary_read_usage_perc"
DROPPED_BLOCKS = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
DROPPED_STORES = "vllm:kv_offload_tiering_backpressure_stores_dropped"
CASCADE_QUEUE = f"{CascadeQueue.__module__}.{CascadeQueue.__name__}"


class RecordingConnector(SessionTierConnector):
    """Ours, keeping what vLLM's scheduler takes of the stats every step
    (what reaches ``/metrics``) for the G3 tier: counters summed, gauges'
    peak and last value."""

    total: dict[str, float] = {}
    peak: dict[str, float] = {}
    last: dict[str, float] = {}

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if stats is not None:
            for name, values in stats.data["data"].items():
                if TIER not in values:
                    continue
                v, kind = values[TIER], stats.data["types"][name]
                if kind == "counter":
                    self.total[name] = self.total.get(name, 0) + v
                elif kind == "gauge":
                    self.peak[name] = max(self.peak.get(name, 0), v)
                    self.last[name] = v
        return stats


def make(redis_url, g2_chunks=64, timeout_s=30.0, **tier):
    init_none_hash(sha256)
    RecordingConnector.total, RecordingConnector.peak, RecordingConnector.last = {}, {}, {}
    g3 = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": redis_url,
        "namespace": f"bp-{time.monotonic_ns()}",
        "timeout_s": timeout_s,
        **tier,
    }
    return steps.make_scheduler(
        True,
        steps.StepSpec(context=64 * steps.BLOCK, running=16, g2_chunks=g2_chunks),
        connector=(RecordingConnector.__name__, __name__),
        extra_config={"secondary_tiers": [g3]},
    )


class Stall:
    """Redis holding every write (``CLIENT PAUSE WRITE``) while on."""

    def __init__(self, url):
        self._r = redis.Redis.from_url(url)

    def on(self):
        self._r.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")

    def off(self):
        self._r.execute_command("CLIENT", "UNPAUSE")


@pytest.fixture
def stall(redis_url):
    s = Stall(redis_url)
    yield s
    s.off()


def request(i: int, chunks: int) -> Request:
    """Session ``s<i>``'s request: ``chunks`` full blocks of its own (a chunk
    is a block here), 2 tokens out."""
    base = 1 + i * (chunks + 1) * steps.BLOCK
    req = steps.session_request(
        f"r{i}", [base + t for t in range(chunks * steps.BLOCK + 3)], f"s{i}", 2
    )
    return req


def step_until(sched, done, what, add=None, timeout_s=60.0) -> None:
    """Step the scheduler until ``done()`` with no request left and every
    store job reported done (in the next step's output, as vLLM's worker
    reports it); ``add(step)`` may add requests first. Idle steps wait a
    little: lookups and G3 copies run on threads."""
    pending: set[int] = set()
    until, n = time.monotonic() + timeout_s, 0
    while not (done() and not sched.has_unfinished_requests() and not pending):
        assert time.monotonic() < until, what
        if add is not None:
            add(n)
        n += 1
        pending = steps.step(sched, pending)


def serve(sched, sessions, chunks, per_step=False) -> None:
    """New sessions' requests, all at once or one a step, until each
    finished and its G1 -> G2 stores ended (vLLM then cascades them)."""
    sessions = list(sessions)
    if not per_step:
        for i in sessions:
            sched.add_request(request(i, chunks))
    added = []

    def add(_):
        if per_step and len(added) < len(sessions):
            added.append(sessions[len(added)])
            sched.add_request(request(added[-1], chunks))

    step_until(
        sched,
        lambda: len(added) == len(sessions) or not per_step,
        "the requests did not finish",
        add,
    )


def drain(sched) -> None:
    """Step until the G3 tier ended every cascade and vLLM collected it."""
    (g3,) = sched.connector.manager.secondary_tiers
    step_until(sched, lambda: not g3.has_pending_work(), "the cascades did not end")


def in_tier(manager, tier, sessions) -> int:
    with manager.lock:
        return sum(len(manager.index.resolve_session(f"s{i}").per_tier[tier]) for i in sessions)


def test_the_default_is_an_eighth_of_g2_and_at_least_one_backend_call():
    assert default_max_chunks(1 << 16, 2 << 20, 64 << 20) == 1 << 13  # G2 128 GiB: 16 GiB
    assert default_max_chunks(1 << 10, 2 << 20, 64 << 20) == 128  # G2 2 GiB: 256 MiB
    assert default_max_chunks(64, 2 << 20, 64 << 20) == 32  # never below a call
    assert default_max_chunks(12, 64 << 10, 64 << 20) == 1024
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="backpressure.max_chunks"):
            CascadeQueue(max_chunks=bad)


def test_by_default_a_stalled_g3_carries_a_bounded_backlog_and_the_rest_is_dropped(
    redis_url, stall
):
    # G2 128 MiB of 4 KiB chunks: the default is one call's 64 MiB, half of
    # G2 (an eighth is less). Without it the queue took every G2 chunk.
    g2 = 32768
    bound = default_max_chunks(g2, steps.CHUNK_BYTES, BATCH_BYTES)
    assert bound == BATCH_BYTES // steps.CHUNK_BYTES == g2 // 2
    sched = make(redis_url, g2_chunks=g2)
    stall.on()  # from here every put waits
    try:
        manager = sched.connector.manager
        (g3,) = manager.secondary_tiers
        assert isinstance(g3.bp_detector, CascadeQueue) and g3.bp_detector.max_chunks == bound
        n = bound // 64 + 40  # 64-chunk prompts, one a step
        serve(sched, range(n), 64, per_step=True)
        # Past the bound by one step's cascades at most; the others dropped.
        queued = g3.bp_detector.chunks
        assert bound <= queued <= bound + 2 * 64
        assert RecordingConnector.peak[READ_USAGE] * g2 == queued
        assert RecordingConnector.peak[ACTIVE] == queued // 64
        assert RecordingConnector.total[DROPPED_BLOCKS] == n * 64 - queued
        assert RecordingConnector.total[DROPPED_STORES] == n - queued // 64
        for name in (ACTIVE, READ_USAGE, DROPPED_BLOCKS, DROPPED_STORES):  # on /metrics
            assert name in SessionTierSpec.build_metric_definitions(
                {
                    "cpu_bytes_to_use": 1 << 20,
                    "secondary_tiers": [
                        {"type": "RedisTier", "module_path": "sessionkv.tiers.g3.backends.redis"}
                    ],
                }
            )
        assert in_tier(manager, Tier.G2, range(n)) == n * 64  # G2 took every store
        stall.off()
        drain(sched)
        assert g3.bp_detector.chunks == 0 and RecordingConnector.last[ACTIVE] == 0
        assert in_tier(manager, Tier.G3, range(n)) == queued  # the dropped stay in G2
        serve(sched, [n], 64)  # the backlog gone, cascades go again
        drain(sched)
        assert in_tier(manager, Tier.G3, [n]) == 64
    finally:
        sched.shutdown()


def test_a_users_own_backpressure_wins_and_queues_every_cascade_of_a_stall(redis_url, stall):
    # vLLM's EMA detector learns from ended cascades only: a stall is never
    # pressure, so the queue takes every cascade (what the default bounds).
    sched = make(redis_url, backpressure={"backpressure_cls": "EMABackpressureDetector"})
    stall.on()
    try:
        (g3,) = sched.connector.manager.secondary_tiers
        assert type(g3.bp_detector) is EMABackpressureDetector
        serve(sched, range(12), 4, per_step=True)
        assert RecordingConnector.peak[READ_USAGE] * 64 == 48
        assert RecordingConnector.total.get(DROPPED_BLOCKS, 0) == 0
        stall.off()
        drain(sched)
        assert in_tier(sched.connector.manager, Tier.G3, range(12)) == 48
    finally:
        sched.shutdown()


def test_a_users_cascade_queue_bounds_what_is_carried_not_a_steps_burst(redis_url, stall):
    sched = make(redis_url, backpressure={"backpressure_cls": CASCADE_QUEUE, "max_chunks": 8})
    stall.on()
    try:
        manager = sched.connector.manager
        (g3,) = manager.secondary_tiers
        assert g3.bp_detector.max_chunks == 8
        serve(sched, range(4), 4)  # one step's 16 chunks: all go
        assert g3.bp_detector.chunks == 16
        serve(sched, range(4, 6), 4, per_step=True)  # carried 16: dropped
        assert g3.bp_detector.chunks == 16
        assert RecordingConnector.total[DROPPED_BLOCKS] == 8
        stall.off()
        drain(sched)
        assert in_tier(manager, Tier.G3, range(6)) == 16
    finally:
        sched.shutdown()


def test_failed_cascades_leave_the_queue(redis_url, stall):
    # vLLM 0.32 tells a detector of successful cascades only: the queue counts
    # what vLLM collects, failures too, so a failing tier does not wedge it.
    sched = make(
        redis_url,
        timeout_s=1.0,
        retry_s=0.1,
        backpressure={"backpressure_cls": CASCADE_QUEUE, "max_chunks": 4},
    )
    stall.on()
    try:
        manager = sched.connector.manager
        (g3,) = manager.secondary_tiers
        serve(sched, range(2), 4)
        assert g3.bp_detector.chunks == 8
        drain(sched)  # the puts pass their deadline and fail
        assert g3.bp_detector.chunks == 0
        assert in_tier(manager, Tier.G3, range(2)) == 0
        stall.off()
        time.sleep(1.0)  # past the breaker's retry
        serve(sched, range(2, 4), 4)
        drain(sched)
        assert in_tier(manager, Tier.G3, range(2, 4)) == 8
    finally:
        sched.shutdown()
