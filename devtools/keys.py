"""Chunk and block keys for tests and benches, in vLLM's ``OffloadKey`` layout:
a block hash followed by the 4-byte KV cache group id (group 0 here)."""

from __future__ import annotations

GROUP_0 = bytes(4)


def block_key(ident: int | str) -> bytes:
    """A stand-in key: ``ident`` as a 32-byte hash (an int big-endian, a name
    right-aligned and dot-padded, readable in failure messages), group 0."""
    if isinstance(ident, str):
        return ident.encode().rjust(32, b".") + GROUP_0
    return ident.to_bytes(32, "big") + GROUP_0


def keys_of(llm, tokens: list[int]) -> list[bytes]:
    """The keys vLLM itself computes for a prompt's full blocks (its own
    block hashing, with the engine's hash algorithm and block size)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    cfg = llm.llm_engine.vllm_config.cache_config
    fn, bs = get_hash_fn_by_name(cfg.prefix_caching_hash_algo), cfg.block_size
    parent, out = None, []
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs])
        out.append(parent + GROUP_0)
    return out
