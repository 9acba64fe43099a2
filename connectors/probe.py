"""What ``sessionkv doctor`` asks an engine (the control channel's ``probe``):
how this engine hashes a prompt, through vLLM's own request block hasher, and
what could keep it from sharing KV with another engine.

Runs on the control channel's thread. Hashing builds a ``Request`` the way
the engine core does (the hash function named by
``prefix_caching_hash_algo``, the block-hash root vLLM derived from
``PYTHONHASHSEED``), so engines that would name the same prompt's blocks
differently give different answers here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sessionkv.tiers.g3.tier import G3Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from sessionkv.connectors.manager import SessionTierManager

Probe = Callable[[list[int]], dict[str, Any]]


def make_probe(vllm_config: VllmConfig, block_size: int, manager: SessionTierManager) -> Probe:
    """The engine's answer to a probe of token ids (see the module docstring)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    algo = vllm_config.cache_config.prefix_caching_hash_algo
    # One KV cache group (check_supported): hashes at the block size.
    hasher = kv_cache_utils.get_request_block_hasher(block_size, get_hash_fn_by_name(algo))
    g3 = [t for t in manager.secondary_tiers if isinstance(t, G3Tier)]

    def probe(tokens: list[int]) -> dict[str, Any]:
        req = Request(
            "sessionkv-probe", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher
        )
        return {
            "block_hashes": [bytes(h).hex() for h in req.block_hashes],
            "block_size": block_size,
            "hash_algo": algo,
            "hash_root": bytes(kv_cache_utils.NONE_HASH).hex(),
            # Reported, not used: vLLM derives the root from it (unset: random per start).
            "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
            "g3": [
                {
                    "tier": t.tier_type,
                    "objects": t.prefix,
                    "identity": t.identity,
                    "error": t.health(),
                }
                for t in g3
            ],
        }

    return probe
