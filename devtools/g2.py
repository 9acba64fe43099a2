"""G2 and a disk G3 built outside an engine, as ``SessionTierSpec.get_manager``
builds them (the composition root), for the tests and benches that drive the
manager, the service or a tier without vLLM's scheduler."""

from __future__ import annotations

import uuid

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from sessionkv.devtools.engines import MODELS
from sessionkv.devtools.g3_spec import standalone_spec
from sessionkv.events import EventLog
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.tiers.g2.tier import QuarantinedPrimaryTier, SessionPrimaryTier
from sessionkv.tiers.g3.backends.disk import DiskTier
from sessionkv.tiers.g3.io import Quarantine


def standalone_g2(
    num_chunks: int,
    chunk_bytes: int,
    index: SessionPrefixIndex,
    quarantine: Quarantine | None = None,
    event_log: EventLog | None = None,
    page_size: int = 4096,
    **kwargs,
) -> SessionPrimaryTier:
    """G2 of ``num_chunks`` chunks of ``chunk_bytes`` on its own shared region,
    with the session policy, one block a chunk; a ``QuarantinedPrimaryTier``
    when given the ``quarantine`` (with G3 tiers, as the spec builds it).
    ``kwargs`` go to the tier (``enable_events``)."""
    region = SharedOffloadRegion(
        engine_id=f"g2-{uuid.uuid4().hex[:8]}",
        num_chunks=num_chunks,
        rank=None,
        kv_bytes_per_chunk=chunk_bytes,
        cpu_page_size=page_size,
    )
    parts = dict(
        num_chunks=num_chunks,
        mmap_region=region,
        cache_policy=SessionCachePolicy.__name__,
        cache_policy_module_path=SessionCachePolicy.__module__,
        index=index,
        blocks_per_chunk=1,
        event_log=event_log,
        **kwargs,
    )
    if quarantine is None:
        return SessionPrimaryTier(**parts)
    return QuarantinedPrimaryTier(quarantine=quarantine, **parts)


def disk_g3(primary: SessionPrimaryTier, path: str, max_bytes: int, **kwargs) -> DiskTier:
    """A disk G3 over ``primary``'s region, for the tiny model's layout;
    ``kwargs`` go to the tier (``quarantine``, ``observer``)."""
    view = primary.get_kv_memoryview()
    spec = standalone_spec(str(MODELS / "tiny"), view.strides[0])
    return DiskTier(spec, view, "disk", path=path, max_bytes=max_bytes, **kwargs)
