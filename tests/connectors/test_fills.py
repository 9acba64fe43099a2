"""FillWatch (connectors/fills.py): a step looks only at the requests that can
fill a block in it, and no request's block is admitted later than the step
that fills it. The rules alone, then a real vLLM ``Scheduler`` (no model:
``bench/scale_steps.py`` makes the outputs) with SessionTierConnector, whose
index must hold every full block of every request after every step, through
chunked prefills beside decodes, a request left unscheduled, and finishes."""

import pytest
import scale_steps as steps
from vllm.v1.request import RequestStatus

from sessionkv.connectors.fills import FillWatch
from sessionkv.types import Tier


def test_a_decode_step_looks_only_at_the_requests_filed_for_it():
    w = FillWatch()
    sched = {"a": 1, "b": 1, "c": 1}
    assert list(w.step(sched, 3)) == []
    w.file("a", 1)
    w.file("b", 3)
    assert list(w.step(sched, 3)) == ["a"]  # step 2: a's tokens are in
    w.file("a", 16)
    assert list(w.step(sched, 3)) == []  # step 3
    assert list(w.step(sched, 3)) == ["b"]  # step 4: b, 3 tokens after step 1
    w.file("b", 5)
    assert len(w) == 2


def test_a_step_with_more_than_one_token_for_a_request_looks_at_all_it_schedules():
    w = FillWatch()
    w.file("a", 16)
    assert sorted(w.step({"a": 1, "b": 40}, 41)) == ["a", "b"]
    w.look_now("c")  # scheduled afresh in this pass
    w.file("a", 16)
    assert list(w.step({"a": 1}, 1)) == ["c"]


def test_a_refiling_leaves_the_old_entry_stale_and_forget_ends_it():
    w = FillWatch()
    w.file("a", 4)
    w.look_now("a")
    assert list(w.step({"a": 1}, 1)) == ["a"]  # step 1
    w.file("a", 1)
    assert list(w.step({"a": 1}, 1)) == ["a"]  # step 2
    w.forget("a")
    for _ in range(4):  # its step-4 entry is stale
        assert list(w.step({"a": 1}, 1)) == []
    assert len(w) == 0 and not w._at


def _index_holds_every_full_block(sched, reqs) -> int:
    index = sched.connector.index
    checked = 0
    for r in reqs:
        if r.is_finished() or r.status != RequestStatus.RUNNING:
            continue
        full = min(len(r.block_hashes), r.num_computed_tokens // steps.BLOCK)
        keys = sched.connector._tracked[r.request_id].keys_upto(full)
        for i, k in enumerate(keys):
            copies = index.copies(k)
            assert copies is not None and copies[Tier.G1] >= 1, (r.request_id, i, full)
        checked += full
    return checked


@pytest.mark.parametrize("batch_tokens", [96, 1024])
def test_every_filled_block_is_admitted_in_the_step_that_fills_it(batch_tokens):
    # 96 tokens a step: prefill chunks beside decodes, and requests the
    # budget leaves unscheduled in some steps; 1024: all prefill at once.
    spec = steps.StepSpec(
        context=160, running=6, decode_steps=80, g2_chunks=4096, batch_tokens=batch_tokens
    )
    sched = steps.make_scheduler(True, spec)
    reqs = steps.make_requests(spec)
    for r in reqs:
        sched.add_request(r)
    pending, checked, decode_steps = set(), 0, 0
    try:
        for n in range(80):
            out = sched.schedule()
            meta = out.kv_connector_metadata
            sched.update_from_output(out, steps.model_output(out, pending))
            pending = set(meta.load_jobs) | set(meta.store_jobs)
            decode_steps += 0 < out.total_num_scheduled_tokens == len(out.num_scheduled_tokens)
            checked += _index_holds_every_full_block(sched, reqs)
            if n == 60:
                sched.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
        assert decode_steps >= 40 and checked > 0
        assert len(sched.connector._fills) == len(reqs) - 1
    finally:
        sched.shutdown()


def test_the_index_has_room_for_what_g1_and_g2_hold_before_the_first_step():
    # A growth copies every index array inside the step that needs it (1.9 ms
    # at 65,536 nodes, a decode step of bench/scale.py at 256 x 4k): the
    # connector reserves G1's blocks plus G2's when it binds vLLM's block pool.
    spec = steps.StepSpec(
        context=1024, running=24, decode_steps=20, g2_chunks=4096, batch_tokens=8192
    )
    sched = steps.make_scheduler(True, spec)
    reqs = steps.make_requests(spec)
    for r in reqs:
        sched.add_request(r)
    tree = sched.connector.index._tree
    room = len(tree.parent)
    pool = sched.kv_cache_manager.block_pool
    pending = set()
    try:
        assert room >= pool.num_gpu_blocks + spec.g2_chunks
        for _ in range(20):
            out = sched.schedule()
            meta = out.kv_connector_metadata
            sched.update_from_output(out, steps.model_output(out, pending))
            pending = set(meta.load_jobs) | set(meta.store_jobs)
        # more nodes than the tree starts with room for, and it never grew
        assert len(tree) > 1024 and len(tree.parent) == room
    finally:
        sched.shutdown()
