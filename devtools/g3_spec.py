"""A stand-in for vLLM's ``OffloadingSpec``, for a G3 tier used outside an
engine (the contract tests, the tier bench)."""

from __future__ import annotations

import types

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from sessionkv.tiers.g3.spec import IDENTITY_KEY


def standalone_identity(**changes) -> dict:
    """What ``SessionTierConnector`` passes a G3 tier about the model
    (``connectors.vllm.model_identity``) for an engine with no quantization,
    no overrides, no LoRA, on one node; ``changes`` replace fields."""
    return {
        "revision": None,
        "quantization": None,
        "kv_cache_dtype": "auto",
        "kv_scales": "checkpoint",
        "kv_skip_layers": [],
        "hf_overrides": {},
        "lora": False,
        "nnodes": 1,
        "executor": "mp",
        **changes,
    }


def standalone_spec(model: str, chunk_bytes: int, block_size: int = 32, dtype: str = "float32"):
    """What a ``G3Tier`` reads of vLLM's ``OffloadingSpec``, for a tier used
    outside an engine (the contract tests, the tier bench): one full-attention
    group, one block per chunk, no parallelism."""
    extra = {IDENTITY_KEY: standalone_identity()}
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(block_size, ("layer.0",), 0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="standalone",
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(block_size, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return types.SimpleNamespace(config=cfg, extra_config=extra)
