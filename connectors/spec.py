"""``SessionTierSpec``: vLLM's tiering spec with sessionkv's configuration and a
CPU-platform worker.

G2 is vLLM's CPU primary tier in the shared host region; G3 tiers plug in as
``SecondaryTierManager``s. On CUDA/XPU the worker is vLLM's own; on the CPU
platform (where vLLM's refuses to start) it is ``TorchCopyWorker`` over the
same shared region.

The spec is built in the scheduler process and in every worker process; it
parses the configuration in each (once per process, at start). In the
scheduler process ``get_manager`` is the composition root: it builds every
scheduler-side part and hands each its collaborators as constructor arguments.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from sessionkv.config import SessionKVConfig, parse_extra_config, vllm_extra_config
from sessionkv.connectors.cpu_worker import TorchCopyWorker
from sessionkv.connectors.manager import SessionTierManager
from sessionkv.connectors.metrics import DEFINITIONS as METRICS
from sessionkv.engine.service import G3Copies
from sessionkv.events import EventLog
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.keys import G3_MAC, derive
from sessionkv.tiers import compat
from sessionkv.tiers.g2 import regions
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.tiers.g2.tier import QuarantinedPrimaryTier, SessionPrimaryTier
from sessionkv.tiers.g3.backpressure import CascadeQueue, default_max_chunks
from sessionkv.tiers.g3.tier import BATCH_BYTES, G3Tier, Quarantine


def has_device_worker() -> bool:
    """Whether vLLM's own G1 <-> G2 worker runs on this platform."""
    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class SessionTierSpec(TieringOffloadingSpec):
    """Tiering spec whose G2 policy comes from the sessionkv policy file."""

    def __init__(self, config: OffloadingConfig):
        self.sessionkv: SessionKVConfig = parse_extra_config(config.extra_config)
        # vLLM's spec reads G2's size and the G3 tiers from extra_config: the
        # policy file's tier stack, when it gives one, goes there.
        super().__init__(
            dataclasses.replace(
                config, extra_config=vllm_extra_config(config.extra_config, self.sessionkv)
            )
        )
        # Ours, not vLLM's ``_manager``/``_worker``: get_manager and get_worker
        # are ours here, and the region is the primary tier's to release.
        self._session_manager: SessionTierManager | None = None
        self._cpu_worker: TorchCopyWorker | None = None
        eviction = self.sessionkv.policy.g2.eviction
        if eviction == "session":
            self.eviction_policy = SessionCachePolicy.__name__
            self.cache_policy_module_path: str | None = SessionCachePolicy.__module__
        else:
            self.eviction_policy = eviction
            self.cache_policy_module_path = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict) -> dict:
        """vLLM's tiering metrics (of the tiers the policy file may name) and
        sessionkv's (``connectors.metrics``)."""
        extra = vllm_extra_config(extra_config, parse_extra_config(extra_config))
        return {**super().build_metric_definitions(extra), **METRICS}

    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager built from our parts: the same shared region,
        primary tier and secondary tiers as ``TieringOffloadingSpec`` (a copy
        of its ``get_manager``; ``compat`` gives what differs by release), with the
        primary tier and the manager keeping the SessionPrefixIndex in step.
        The G2 quarantine, the G3 copy queue and the event log (when the
        policy names a secret: the control channel streams it) are built
        first and shared by the parts that use them."""
        if self._session_manager is not None:
            return self._session_manager
        if int(self.extra_config.get("store_threshold", 0)) >= 2:
            raise ValueError("store_threshold is not supported with SessionTierConnector")
        policy = self.sessionkv.policy
        index = SessionPrefixIndex(
            idle_timeout_s=policy.sessions.idle_timeout_s,
            max_tombstones=policy.sessions.max_tombstones,
        )
        quarantine, g3_copies = Quarantine(), G3Copies()
        events = EventLog() if policy.trust.secret is not None else None
        region = self._scheduler_region()
        primary = None
        secondary = []
        try:
            g2 = dict(
                num_chunks=self.num_chunks,
                mmap_region=region,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                index=index,
                blocks_per_chunk=self.blocks_per_chunk,
                event_log=events,
                **compat.primary_kwargs(self),
            )
            # Only a G3 load can hold a G2 slot past its job (the quarantine).
            primary = (
                QuarantinedPrimaryTier(quarantine=quarantine, **g2)
                if self.secondary_tier_configs
                else SessionPrimaryTier(**g2)
            )
            view = primary.get_kv_memoryview()
            for tier_config in self.secondary_tier_configs:
                secondary.append(self._secondary_tier(tier_config, view, quarantine, g3_copies))
            manager = SessionTierManager(
                primary,
                secondary,
                index,
                self.sessionkv,
                g3_copies=g3_copies,
                event_log=events,
                **compat.manager_kwargs(self),
            )
        except Exception:
            for tier in reversed(secondary):
                tier.shutdown()
            if primary is not None:
                primary.shutdown()  # releases the region too
            else:
                region.cleanup()
            raise
        self._session_manager = manager
        return manager

    def _scheduler_region(self) -> SharedOffloadRegion:
        """The scheduler's mapping of G2 (tiers/g2/regions.py): regions
        killed engines left are reclaimed first; this one is registered
        before it is mapped. On a device the workers made it already and it
        is joined, never created: a region made here would be a private copy
        that no worker writes."""
        regions.reclaim()
        path = regions.region_path(self.config.engine_id)
        regions.register(path)
        made_by_workers = regions.expect_existing(path) if has_device_worker() else None
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=None,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        if made_by_workers is not None:
            try:
                regions.check_joined(path, region.fd, made_by_workers)
            except RuntimeError:
                region.cleanup()
                raise
        return region

    def _secondary_tier(
        self, tier_config: dict, view: memoryview, quarantine: Quarantine, g3_copies: G3Copies
    ):
        """One of vLLM's secondary tiers; a G3 tier also gets the G2
        quarantine, reports its copies to ``g3_copies``, seals its
        objects with a MAC when the policy names a cluster secret, and,
        unless the user gave a ``backpressure`` (vLLM's key, top-level or
        per tier), drops cascades while it carries a backlog of an eighth of
        G2 (``tiers/g3/backpressure.py``; measured in
        bench/results/2026-12-07-g3-backpressure.md)."""
        if issubclass(SecondaryTierFactory.get_tier_class(tier_config), G3Tier):
            for key in ("quarantine", "observer", "seal_key"):
                if key in tier_config:
                    raise ValueError(
                        f"secondary_tiers: {key} is set by sessionkv; remove "
                        f"it from the {tier_config['type']} tier"
                    )
            secret = self.sessionkv.policy.trust.secret
            tier_config = {
                **tier_config,
                "quarantine": quarantine,
                "observer": g3_copies.observe,
                "seal_key": derive(secret, G3_MAC) if secret else None,
            }
            if "backpressure" not in tier_config:  # vLLM merged in the user's, if any
                tier_config["backpressure"] = {
                    "backpressure_cls": f"{CascadeQueue.__module__}.{CascadeQueue.__name__}",
                    "max_chunks": default_max_chunks(
                        self.num_chunks, cast(tuple[int, ...], view.strides)[0], BATCH_BYTES
                    ),
                }
        return SecondaryTierFactory.create_secondary_tier(tier_config, view, self)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """vLLM's worker on a device, ours on the CPU platform; either way
        this process registers the region before mapping it (regions.py)."""
        regions.register(regions.region_path(self.config.engine_id))
        if has_device_worker():
            return super().get_worker(kv_caches)
        if self._cpu_worker is None:
            self._cpu_worker = self._create_cpu_worker(kv_caches)
        return self._cpu_worker

    def _create_cpu_worker(self, kv_caches: CanonicalKVCaches) -> TorchCopyWorker:
        if self.config.canonical_layout:
            raise ValueError(
                "canonical_layout is not supported on the CPU platform; remove it "
                "from kv_connector_extra_config"
            )
        # The same region layout as TieringOffloadingSpec.create_worker, so the
        # scheduler's view (and every G3 tier reading it) sees these bytes.
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return TorchCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
