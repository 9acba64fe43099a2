"""What a G3 tier reads of vLLM's ``OffloadingSpec``: the identity of this
engine's chunks (``spec_identity``, for ``tiers.fingerprint``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fingerprint import identity_fields, weights_digest

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec


def spec_identity(spec: "OffloadingSpec", chunk_bytes: int) -> dict:
    """The identity fields of this engine's chunks (``tiers.fingerprint``),
    ``none_hash`` left empty: vLLM sets it after it built the scheduler."""
    cfg = spec.config
    par = cfg.parallel
    return identity_fields(
        weights=weights_digest(cfg.model.name), dtype=str(cfg.model.dtype),
        block_size=cfg.cache.tokens_per_hash, blocks_per_chunk=cfg.cache.blocks_per_chunk,
        layout=f"{cfg.kv_cache_layout}/canonical={cfg.canonical_layout}"
               f"/replicated={cfg.replicated_layout}",
        tp=par.tp_size, pp=par.pp_size, pcp=par.pcp_size, dcp=par.dcp_size,
        none_hash=b"", chunk_bytes=chunk_bytes)
