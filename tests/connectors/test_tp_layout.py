"""Tensor parallel on a device: every rank's bytes reach G3 and come back.

On CUDA each TP rank's worker maps G2 itself (``TieringOffloadingSpec.
create_worker``: vLLM's ``SharedOffloadRegion`` with ``rank`` and
``cpu_page_size_per_worker``) and writes its KV through its own worker views
(``create_next_worker_view``, one per KV tensor, as ``CPUOffloadingWorker``
makes them): a chunk's row holds every rank's slot side by side. The
scheduler maps the same file with no rank, and G3 tiers copy whole rows from
its view. Everything here is vLLM's own code on the vLLM this process runs
(``scripts/test`` runs the file on 0.32 and 0.33): the offloading config from
``build_offloading_config`` over a ``VllmConfig`` with ``tensor_parallel_size``
2, 4 and 8, the region geometry from the spec, each rank's region from
``create_worker``; only vLLM's copy engine (``CPUOffloadingWorker``, CUDA
only) is stood in for by the views it makes, and written through them.

The scheduler side is sessionkv's (``SessionTierSpec.get_manager``) with a
real disk G3 tier in ``tmp_path``: the chunks are stored into G2 through the
manager, cascaded to G3 by vLLM's tiering manager (write-through), then
prefetched by a second engine (another region, its ranks' views zero) through
the Mover, and every rank's bytes are read back through that engine's worker
views, byte-exact."""

import dataclasses
import os
import time
import uuid

import numpy as np
import pytest
import torch
import vllm.v1.kv_offload.tiering.spec as vllm_tiering_spec
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from sessionkv.connectors.spec import SessionTierSpec
from sessionkv.connectors.startup import model_identity
from sessionkv.devtools.engines import TINY
from sessionkv.devtools.keys import block_key
from sessionkv.hints import Action, Status
from sessionkv.tiers.g3.spec import IDENTITY_KEY

BLOCK, BLOCKS_PER_CHUNK, LAYERS, KV_HEADS, HEAD = 16, 2, 2, 8, 64
G2_CHUNKS, CHUNKS = 16, 6


class DeviceWorkerViews:
    """Stands in for vLLM's ``CPUOffloadingWorker`` (its copy engine needs
    CUDA) as far as G2 goes: one worker view per KV tensor, of the tensor's
    page times blocks per chunk, in tensor order, as its constructor makes
    them (direct layout)."""

    def __init__(
        self, kv_caches, blocks_per_chunk, num_cpu_chunks, mmap_region, canonical_layout=False
    ):
        assert not canonical_layout
        self.region = mmap_region
        self.views = [
            mmap_region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk)
            for t in kv_caches.tensors
        ]


def engine(tp: int, g3_path: str, monkeypatch):
    """One TP engine's G2 as vLLM builds it on a device: each rank's region
    and views (``create_worker``), then the scheduler's manager with G3."""
    init_none_hash(sha256)
    engine_id = f"tp{tp}-{uuid.uuid4().hex[:8]}"
    heads = KV_HEADS // tp
    page = 2 * BLOCK * heads * HEAD * 4  # K and V of a block, float32
    g3 = {
        "type": "DiskTier",
        "module_path": "sessionkv.tiers.g3.backends.disk",
        "path": g3_path,
        "max_bytes": 1 << 26,
        "namespace": "tp",
    }
    kvt = KVTransferConfig(
        kv_connector="SessionTierConnector",
        kv_connector_module_path="sessionkv.connectors.vllm",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "block_size": BLOCK * BLOCKS_PER_CHUNK,
            "secondary_tiers": [g3],
            "cpu_bytes_to_use": G2_CHUNKS * LAYERS * page * tp * BLOCKS_PER_CHUNK,
        },
    )
    config = VllmConfig(
        model_config=ModelConfig(
            model=TINY,
            dtype="float32",
            seed=0,
            hf_overrides={"num_attention_heads": KV_HEADS, "num_key_value_heads": KV_HEADS},
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
    )
    kvt.kv_connector_extra_config[IDENTITY_KEY] = model_identity(config)
    # What every rank's KV cache manager holds: its share of the heads.
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32
    )
    assert spec.page_size_bytes == page
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    offloading = build_offloading_config(config, kv_config)
    assert (offloading.parallel.tp_size, offloading.parallel.world_size) == (tp, tp)
    assert not offloading.replicated_layout  # one slot per rank in every row
    monkeypatch.setattr(vllm_tiering_spec, "CPUOffloadingWorker", DeviceWorkerViews)
    caches = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(torch.zeros(64, page, dtype=torch.int8), page) for _ in names
        ],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(LAYERS)]],
    )
    workers = []
    for rank in range(tp):  # the workers map G2 first (vLLM's device order)
        rank_spec = SessionTierSpec(
            dataclasses.replace(
                offloading, parallel=dataclasses.replace(offloading.parallel, rank=rank)
            )
        )
        workers.append(TieringOffloadingSpec.create_worker(rank_spec, caches))
    scheduler = SessionTierSpec(offloading)
    assert scheduler.cpu_page_size_per_worker == LAYERS * page * BLOCKS_PER_CHUNK
    assert scheduler.kv_bytes_per_chunk == tp * scheduler.cpu_page_size_per_worker
    return scheduler.get_manager(), workers


def settle(manager, done, timeout_s: float = 30.0) -> None:
    """Step the manager as vLLM's scheduler does when idle until ``done()``."""
    deadline = time.monotonic() + timeout_s
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    while not done():
        assert time.monotonic() < deadline, "G3 copies did not end"
        time.sleep(0.01)
        with manager.lock:
            manager.on_schedule_end(end)
            manager.service.apply_moves()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_ranks_bytes_reach_g3_and_come_back_byte_exact(tmp_path, monkeypatch, tp):
    keys = [block_key(f"tp-{i}") for i in range(CHUNKS)]
    rng = np.random.default_rng(tp)
    store, store_workers = engine(tp, str(tmp_path / "g3"), monkeypatch)
    load = load_workers = None
    try:
        # Every rank writes its own bytes into the chunks' G2 slots, through its views.
        ctx = ReqContext(req_id="turn")
        with store.lock:
            store.on_new_request(ctx)
            slots = list(store.prepare_store(keys, ctx).store_spec.chunk_ids)
        wrote = [
            [rng.integers(-128, 128, (CHUNKS, v.shape[1]), dtype=np.int8) for v in w.views]
            for w in store_workers
        ]
        for w, data in zip(store_workers, wrote):
            for view, rows in zip(w.views, data):
                view[slots] = torch.from_numpy(rows)
        g3 = store.secondary_tiers[0]
        with store.lock:
            store.complete_store(keys, ctx)  # vLLM's tiering manager cascades to G3
        settle(
            store,
            lambda: (
                all(g3._backend.exists([g3.name(k) for k in keys])) and not store.has_pending_work()
            ),
        )
        with store.lock:
            store.on_request_finished(ctx)
        # A whole row went: every rank's slot (and the row's padding) in each object.
        row = store.primary_tier.get_kv_memoryview().strides[0]
        assert row >= tp * sum(v.shape[1] for v in store_workers[0].views)
        assert all(os.stat(g3._backend.path_of(g3.name(k))).st_size >= row for k in keys)

        # Another engine, its G2 empty, prefetches them from G3 (the Mover's path).
        load, load_workers = engine(tp, str(tmp_path / "g3"), monkeypatch)
        assert all(not v[:].any() for w in load_workers for v in w.views)
        with load.lock:
            first = load.service.mover.start(Action.PREFETCH, "back", keys, len(keys), None)
        assert first.status is Status.DEFERRED, first
        settle(load, lambda: not load.service.mover.busy)
        with load.lock:
            back = list(load.primary_tier.prepare_read(keys, ReqContext(req_id="read")).chunk_ids)
        for rank, (w, data) in enumerate(zip(load_workers, wrote)):
            for t, (view, rows) in enumerate(zip(w.views, data)):
                assert torch.equal(view[back], torch.from_numpy(rows)), (rank, t)
    finally:
        for manager, workers in ((store, store_workers), (load, load_workers)):
            if manager is not None:
                manager.shutdown()
            for w in workers or ():
                w.region.cleanup()
