"""G2 slots that an abandoned G3 read may still write stay out of vLLM's
free list until the read ends: ``QuarantinedPrimaryTier`` (vLLM's CPU primary
tier, real) with its ``Quarantine``, driven as the tiering manager drives it.
The late read itself is faked by ``hold``/``release`` (the real one is in
``tests/tiers/test_g3_contract.py``: a stopped Mooncake store process)."""

import uuid

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from sessionkv.devtools.keys import block_key
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.tier import QuarantinedPrimaryTier
from sessionkv.tiers.g3.tier import Quarantine

CTX = ReqContext(req_id="r")
N = 4


@pytest.fixture
def g2():
    region = SharedOffloadRegion(
        engine_id=f"quarantine-{uuid.uuid4().hex[:8]}",
        num_chunks=N,
        rank=None,
        kv_bytes_per_chunk=4096,
        cpu_page_size=4096,
    )
    tier = QuarantinedPrimaryTier(
        num_chunks=N,
        mmap_region=region,
        index=SessionPrefixIndex(),
        blocks_per_chunk=1,
        quarantine=Quarantine(),
        event_log=None,
    )
    yield tier
    tier.shutdown()


def store(g2, *ids):
    out = g2.prepare_store([block_key(i) for i in ids], CTX)
    return None if out is None else sorted(int(c) for c in out.store_spec.chunk_ids)


def test_a_held_slot_is_not_reused_until_its_read_ends(g2):
    a, b = store(g2, 1, 2)
    g2.quarantine.hold([a])  # a load into a is past its deadline
    g2.complete_store([block_key(1), block_key(2)], CTX, False)  # the load failed: both freed
    assert g2.quarantine.held == {a}
    got = store(g2, 3, 4, 5)  # three slots free, not a
    assert a not in got and len(got) == 3
    assert store(g2, 6) is None  # nothing else free or evictable
    g2.quarantine.release([a])  # the late read ended
    assert store(g2, 6) == [a]


def test_a_slot_held_while_still_in_use_is_freed_normally(g2):
    (a,) = store(g2, 1)
    g2.quarantine.hold([a])
    g2.quarantine.release([a])  # the read ended before the job was done
    g2.complete_store([block_key(1)], CTX, False)
    assert store(g2, 2, 3, 4, 5) is not None  # every slot free again


def test_reset_leaves_held_slots_out_until_released(g2):
    ids = store(g2, 1, 2, 3)
    g2.complete_store([block_key(1), block_key(2)], CTX, True)
    g2.quarantine.hold([ids[2]])  # key 3's load is past its deadline
    g2.reset_cache()
    got = store(g2, 4, 5, 6)
    assert ids[2] not in got and len(got) == 3
    assert store(g2, 7) is None
    g2.quarantine.release([ids[2]])
    assert store(g2, 7) == [ids[2]]
