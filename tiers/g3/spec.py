"""What a G3 tier reads of vLLM's ``OffloadingSpec``: the identity of this
engine's chunks (``spec_identity``, for ``tiers.g3.fingerprint``).

vLLM's offloading config names the model only by path and KV dtype, so the
connector passes what else changes K/V (``connectors.vllm.model_identity``,
from the ``VllmConfig``) under ``IDENTITY_KEY`` in the spec's extra config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sessionkv.tiers.g3.fingerprint import FingerprintError, identity_fields, weights_digest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

IDENTITY_KEY = "sessionkv_model_identity"


class TopologyError(ValueError):
    """A parallel layout G3 or the index would serve wrongly: refused at start."""


def check_topology(model: dict, par: Any) -> None:
    """Refuse, naming the setting, what a G3 tier would serve wrongly: ranks
    on more than one node (each node maps its own host region, and G3 and
    the Mover read and write only the scheduler node's, so cascades would
    upload the other ranks' part from the wrong place and promotions fill
    only the head node) and context parallelism (one block hash per G1
    block against chunk keys every ``hashes_per_chunk``: the index and pins
    would not line up with chunks)."""
    if int(par.pcp_size) > 1 or int(par.dcp_size) > 1:
        raise TopologyError(
            f"G3 tiers with context parallelism are refused (prefill_context_parallel_size="
            f"{par.pcp_size}, decode_context_parallel_size={par.dcp_size}): the session index "
            "follows one hash per block, not chunk keys; drop the G3 tiers or set both to 1"
        )
    ranks = int(par.tp_size) * int(par.pp_size)
    if int(model.get("nnodes") or 1) > 1:
        raise TopologyError(
            f"G3 tiers with ranks on {model['nnodes']} nodes (nnodes) are refused: G3 reads "
            "and writes the scheduler node's host memory only; run one node per engine or "
            "drop the G3 tiers"
        )
    if ranks > 1 and model.get("executor") == "ray":
        raise TopologyError(
            f"G3 tiers with distributed_executor_backend=ray and {ranks} ranks "
            "(tensor x pipeline parallel) are refused: Ray may place ranks on other nodes, "
            "whose host memory G3 does not see; use the mp backend on one node"
        )


def spec_identity(spec: OffloadingSpec, chunk_bytes: int) -> dict:
    """The identity fields of this engine's chunks (``tiers.g3.fingerprint``),
    ``none_hash`` left empty: vLLM sets it after it built the scheduler.
    Raises ``FingerprintError`` where G3 would be unsafe."""
    cfg = spec.config
    model: Any = spec.extra_config.get(IDENTITY_KEY)
    if not isinstance(model, dict):
        raise FingerprintError(
            "a G3 tier needs the model identity SessionTierConnector "
            "passes; use kv_connector SessionTierConnector"
        )
    if model.get("lora"):
        raise FingerprintError(
            "G3 with LoRA enabled is refused: a block's key names its adapter by name and "
            "path, not by content, so two engines (or one after an adapter changed) would "
            "share wrong KV; drop --enable-lora or the G3 tiers"
        )
    if model.get("hf_overrides") is None:
        raise FingerprintError(
            "hf_overrides given as a function cannot be fingerprinted; "
            "pass a dict (or drop the G3 tiers)"
        )
    par = cfg.parallel
    check_topology(model, par)
    return identity_fields(
        weights=weights_digest(cfg.model.name, model.get("revision")),
        dtype=str(cfg.model.dtype),
        quantization=model.get("quantization"),
        kv_cache_dtype=str(model.get("kv_cache_dtype")),
        kv_scales=str(model.get("kv_scales")),
        kv_skip_layers=list(model.get("kv_skip_layers") or ()),
        hf_overrides=model["hf_overrides"],
        block_size=cfg.cache.tokens_per_hash,
        blocks_per_chunk=cfg.cache.blocks_per_chunk,
        layout=f"{cfg.kv_cache_layout}/canonical={cfg.canonical_layout}"
        f"/replicated={cfg.replicated_layout}",
        tp=par.tp_size,
        pp=par.pp_size,
        pcp=par.pcp_size,
        dcp=par.dcp_size,
        none_hash=b"",
        chunk_bytes=chunk_bytes,
    )
