"""Issue 52, "Defaults that amplify traffic": G3 write-through had no
backpressure, so a G3 tier slower than the engine's stores queued every
cascade, each holding its G2 slot, ahead of every G3 load. By default each
G3 tier now drops cascades past an eighth of G2 queued
(``tiers/g3_backpressure.py``), a user's own ``backpressure`` wins, and the
queue and the drops are on vLLM's own metrics.

Real parts: vLLM's ``Scheduler`` with ``SessionTierConnector`` built from
``--kv-transfer-config`` (no model: ``bench/scale_steps.py``), a real Redis
G3 tier, and a real stall: Redis's ``CLIENT PAUSE WRITE`` holds every put."""

import copy
import time

import pytest
import redis
import scale_steps as steps
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

from sessionkv.connectors.spec import CASCADE_QUEUE_SHARE, SessionTierSpec
from sessionkv.connectors.vllm import SessionTierConnector
from sessionkv.tiers.g3_backpressure import CascadeQueue
from sessionkv.types import Tier
from test_step_lock import PROMPT_BLOCKS, request

G2_CHUNKS = 64
REQUESTS = 10                       # 4 chunks each: 40 cascades' chunks, under G2's 64
CAP = G2_CHUNKS // CASCADE_QUEUE_SHARE
TIER = ("1:RedisTier",)             # vLLM's tier label
ACTIVE = "vllm:kv_offload_tiering_active_cascade_jobs"
READ_USAGE = "vllm:kv_offload_tiering_primary_read_usage_perc"
DROPPED_BLOCKS = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
DROPPED_STORES = "vllm:kv_offload_tiering_backpressure_stores_dropped"


class RecordingConnector(SessionTierConnector):
    """Ours, keeping the stats vLLM's scheduler takes every step (what
    reaches ``/metrics``)."""

    taken: list[dict] = []

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if stats is not None:
            RecordingConnector.taken.append(copy.deepcopy(stats.data["data"]))
        return stats


def make(redis_url, timeout_s=30.0, **tier):
    init_none_hash(sha256)
    RecordingConnector.taken = []
    g3 = {"type": "RedisTier", "module_path": "sessionkv.tiers.redis", "url": redis_url,
          "namespace": f"bp-{time.monotonic_ns()}", "timeout_s": timeout_s, **tier}
    return steps.make_scheduler(
        True, steps.StepSpec(context=PROMPT_BLOCKS * steps.BLOCK, running=REQUESTS,
                             g2_chunks=G2_CHUNKS),
        connector=(RecordingConnector.__name__, __name__), extra_config={"secondary_tiers": [g3]})


class Stall:
    """Redis holding every write (``CLIENT PAUSE WRITE``) while on."""

    def __init__(self, url):
        self._r = redis.Redis.from_url(url)

    def on(self):
        self._r.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")

    def off(self):
        self._r.execute_command("CLIENT", "UNPAUSE")


@pytest.fixture
def stall(redis_url):
    s = Stall(redis_url)
    yield s
    s.off()


def step_until(sched, done, what, timeout_s=30.0) -> None:
    """Step the scheduler (idle steps wait a little: lookups and G3 copies
    run on threads) until ``done()``; every store job reported done in the
    next step's output, as vLLM's worker reports it."""
    pending: set[int] = set()
    until = time.monotonic() + timeout_s
    while not (done() and not sched.has_unfinished_requests() and not pending):
        assert time.monotonic() < until, what
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            time.sleep(0.01)
        meta = out.kv_connector_metadata
        sched.update_from_output(out, steps.model_output(out, pending))
        pending = set(getattr(meta, "load_jobs", ())) | set(getattr(meta, "store_jobs", ()))


def prefill(sched, first=0, n=REQUESTS) -> None:
    """``n`` new sessions' prompts prefilled and stored in G2 (vLLM then
    cascades them to G3)."""
    for i in range(first, first + n):
        sched.add_request(request(f"r{i}", f"s{i}", 1000 * (i + 1)))
    step_until(sched, lambda: True, "the requests did not finish")


def drain(sched) -> None:
    """Step until the G3 tier ended every cascade and vLLM collected it."""
    (g3,) = sched.connector.manager.secondary_tiers
    step_until(sched, lambda: not g3.has_pending_work(), "the cascades did not end")


def in_tier(manager, tier, sessions) -> int:
    with manager.lock:
        return sum(len(manager.index.resolve_session(f"s{i}").per_tier[tier]) for i in sessions)


def series(name) -> list[float]:
    """The G3 tier's values of a metric, step by step."""
    return [data[name][TIER] for data in RecordingConnector.taken if TIER in data.get(name, {})]


def test_a_stalled_g3_queues_an_eighth_of_g2_and_the_rest_is_dropped(redis_url, stall):
    sched = make(redis_url)
    stall.on()                              # from here every put waits
    try:
        manager = sched.connector.manager
        (g3,) = manager.secondary_tiers
        assert isinstance(g3.bp_detector, CascadeQueue) and g3.bp_detector.max_chunks == CAP
        prefill(sched)
        # The first two cascades (4 chunks each) fill the queue; the other 8 are dropped.
        assert g3.bp_detector.chunks == CAP
        assert max(series(READ_USAGE)) * G2_CHUNKS == CAP
        assert max(series(ACTIVE)) == CAP // PROMPT_BLOCKS
        assert sum(series(DROPPED_BLOCKS)) == REQUESTS * PROMPT_BLOCKS - CAP
        assert sum(series(DROPPED_STORES)) == REQUESTS - CAP // PROMPT_BLOCKS
        for name in (ACTIVE, READ_USAGE, DROPPED_BLOCKS, DROPPED_STORES):   # on /metrics
            assert name in SessionTierSpec.build_metric_definitions(
                {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "RedisTier",
                 "module_path": "sessionkv.tiers.redis"}]})
        stall.off()
        drain(sched)
        assert g3.bp_detector.chunks == 0 and series(ACTIVE)[-1] == 0
        # The dropped chunks stay in G2; G3 got the two cascades let in.
        assert in_tier(manager, Tier.G2, range(REQUESTS)) == REQUESTS * PROMPT_BLOCKS
        assert in_tier(manager, Tier.G3, range(REQUESTS)) == CAP
        # An empty queue lets the next cascades in.
        prefill(sched, first=REQUESTS, n=1)
        drain(sched)
        assert in_tier(manager, Tier.G3, [REQUESTS]) == PROMPT_BLOCKS
    finally:
        sched.shutdown()


def test_a_users_own_backpressure_wins_and_queues_every_cascade_of_a_stall(redis_url, stall):
    # vLLM's EMA detector learns from ended cascades only: a stall is never
    # pressure, so the queue takes every cascade (what the default bounds).
    sched = make(redis_url, backpressure={"backpressure_cls": "EMABackpressureDetector"})
    stall.on()                              # from here every put waits
    try:
        (g3,) = sched.connector.manager.secondary_tiers
        assert type(g3.bp_detector) is EMABackpressureDetector
        prefill(sched)
        assert max(series(READ_USAGE)) * G2_CHUNKS == REQUESTS * PROMPT_BLOCKS
        assert max(series(ACTIVE)) == REQUESTS
        assert sum(series(DROPPED_BLOCKS)) == 0
        stall.off()
        drain(sched)
        assert in_tier(sched.connector.manager, Tier.G3, range(REQUESTS)) == \
            REQUESTS * PROMPT_BLOCKS
    finally:
        sched.shutdown()


def test_failed_cascades_leave_the_queue(redis_url, stall):
    # vLLM 0.32 tells a detector of successful cascades only: the queue counts
    # what vLLM collects, failures too, so a failing tier does not wedge it.
    sched = make(redis_url, timeout_s=1.0, retry_s=0.1)
    stall.on()                              # from here every put waits
    try:
        manager = sched.connector.manager
        (g3,) = manager.secondary_tiers
        prefill(sched, n=2)
        assert g3.bp_detector.chunks == CAP
        drain(sched)                            # the puts pass their deadline and fail
        assert g3.bp_detector.chunks == 0
        assert in_tier(manager, Tier.G3, range(2)) == 0
        stall.off()
        time.sleep(1.0)                         # past the breaker's retry
        prefill(sched, first=2, n=2)
        drain(sched)
        assert in_tier(manager, Tier.G3, range(2, 4)) == 2 * PROMPT_BLOCKS
    finally:
        sched.shutdown()


def test_max_chunks_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="backpressure.max_chunks"):
            CascadeQueue(max_chunks=bad)
