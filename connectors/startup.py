"""What the connector checks and starts when vLLM builds it: the
configurations it refuses (``check_supported``), the spec it binds
(``bind_spec``), the model identity G3 objects carry (``model_identity``),
the G1 probe the index asks (``g1_probe``) and the control channel
(``start_control``). Called once per engine start, on the thread that
builds the connector."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec

from sessionkv.connectors.manager import SessionTierManager
from sessionkv.connectors.probe import Probe
from sessionkv.connectors.spec import SessionTierSpec
from sessionkv.engine.control import ControlChannel

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

logger = init_logger(__name__)
SPEC_NAME = SessionTierSpec.__name__
SPEC_MODULE = SessionTierSpec.__module__


def check_supported(
    kv_role: str | None,
    kv_cache_groups: list[KVCacheGroupSpec],
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    device_worker: bool,
) -> None:
    """Refuse, at start, configurations sessionkv would serve wrongly or untested.
    Accepted on a device: tensor parallel of any size (every rank's slot of a
    G2 row reaches G3 and comes back: tests/connectors/test_tp_layout.py, with
    vLLM's own region code at TP 2, 4 and 8); refused: pipeline parallel."""
    if kv_role != "kv_both":
        raise ValueError(f"kv_role must be 'kv_both' for SessionTierConnector, got {kv_role!r}")
    if len(kv_cache_groups) != 1 or type(kv_cache_groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_groups]
        raise ValueError(
            "SessionTierConnector supports full-attention models with one KV cache "
            f"group; this model has {kinds}"
        )
    if device_worker and pipeline_parallel_size != 1:
        raise ValueError(
            "SessionTierConnector supports pipeline_parallel_size=1 only, got "
            f"{pipeline_parallel_size}: every worker lays out its slot of each G2 row "
            "from one per-worker size, and pipeline stages with different layer counts "
            "may map different region geometry; no test covers it yet"
        )
    if not device_worker and (tensor_parallel_size != 1 or pipeline_parallel_size != 1):
        raise ValueError(
            "SessionTierConnector supports tensor_parallel_size=1 and "
            "pipeline_parallel_size=1 on the CPU platform, got "
            f"{tensor_parallel_size} and {pipeline_parallel_size}"
        )


def bind_spec(extra: dict[str, Any]) -> None:
    """Point vLLM's offloading config at our spec, in place. Every process that
    reads the config (scheduler, workers, the API server's metrics) must see it.
    ``offload_prompt_only`` stays vLLM's (default true: a turn's output is
    stored with the next turn's prompt, if that carries it;
    bench/results/2026-12-07-offload-defaults.md)."""
    for key, ours in (("spec_name", SPEC_NAME), ("spec_module_path", SPEC_MODULE)):
        if extra.get(key, ours) != ours:
            raise ValueError(
                f"{key} is set by SessionTierConnector; remove it from kv_connector_extra_config"
            )
        extra[key] = ours


def model_identity(vllm_config: VllmConfig) -> dict[str, Any]:
    """What changes K/V beyond what vLLM's offloading config names (the
    model's path and KV dtype), for the G3 fingerprint (``tiers.g3.spec``):
    plain values, so the config stays picklable. ``hf_overrides`` is None
    when it is a function (G3 then refuses to start)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    overrides = mc.hf_overrides
    return {
        "revision": mc.revision,
        "quantization": None if mc.quantization is None else str(mc.quantization),
        "kv_cache_dtype": str(cc.cache_dtype),
        # vLLM 0.32 reads KV scales from the checkpoint (the weights digest
        # covers them); a release that computes them at run time says so here
        "kv_scales": "computed" if getattr(cc, "calculate_kv_scales", False) else "checkpoint",
        "kv_skip_layers": sorted(map(str, getattr(cc, "kv_cache_dtype_skip_layers", ()) or ())),
        "hf_overrides": None if callable(overrides) else dict(overrides or {}),
        "lora": vllm_config.lora_config is not None,
        # where the ranks run: G3 and the Mover read and write the scheduler
        # node's host mapping only (tiers.g3.spec refuses what that breaks)
        "nnodes": int(getattr(vllm_config.parallel_config, "nnodes", 1) or 1),
        "executor": str(vllm_config.parallel_config.distributed_executor_backend),
    }


def g1_probe(block_pool: BlockPool):
    """G1 copies of keys, read from vLLM's block pool: 1 while the pool caches
    a block of the key (duplicates count once: the index asks whether G1
    holds a block, not how many). An ``OffloadKey`` of group g is byte for
    byte vLLM's ``BlockHashWithGroupId``."""

    def probe(keys: Sequence[bytes]) -> list[int]:
        # Read the map each time: reset_prefix_cache() replaces it.
        get = block_pool.cached_block_hash_to_block.get_one_block
        return [0 if get(k) is None else 1 for k in keys]

    return probe


def start_control(
    manager: SessionTierManager,
    engine_id: str | None,
    dp_rank: int,
    block_size: int,
    probe: Probe | None = None,
    g1_blocks: int = 0,
    dp_size: int = 1,
) -> ControlChannel | None:
    """The control channel of one engine's DP rank, or None when the policy
    names no secret (the channel always authenticates). ``probe`` answers
    ``sessionkv doctor``. Its ``hello`` names the engine and what a router's
    policy sizes itself by: G1 blocks, G2 chunks and blocks per chunk, and
    the hint rate one client gets."""
    cfg = manager.service.config
    secret = cfg.policy.trust.secret
    if secret is None:
        return None
    port = cfg.control.port + 2 * dp_rank if cfg.control.port else 0
    channel = ControlChannel(
        manager.service,
        secret,
        host=cfg.control.host,
        port=port,
        info={
            "engine_id": engine_id,
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "block_size": block_size,
            "g1_blocks": g1_blocks,
            "g2_chunks": manager.primary_tier.num_chunks,
            "blocks_per_chunk": manager.primary_tier.blocks_per_chunk,
            "hints_per_s": cfg.policy.limits.hints_per_s_per_client,
        },
        rate=cfg.policy.limits.hints_per_s_per_client,
        probe=probe,
    )
    try:
        if cfg.control.endpoint_file:
            path = cfg.control.endpoint_file + (f".dp{dp_rank}" if dp_rank else "")
            channel.write_endpoint_file(path)
    except Exception:
        channel.close()
        raise
    logger.info(
        "sessionkv: control channel %s, events %s", channel.endpoint, channel.events_endpoint
    )
    return channel.start()
