"""The index's G1 view through vLLM's own block pool (``g1_probe``), on the
vLLM this process runs (both passes of ``scripts/test``): blocks the pool
caches count one copy each (duplicates once), blocks it drops or a
``reset_prefix_cache`` forgets are pruned at the next sweep."""

from vllm.v1.core.block_pool import BlockPool

from sessionkv.connectors.startup import g1_probe
from sessionkv.devtools.keys import block_key
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.types import Tier


def test_the_index_follows_vllms_block_pool():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    chain = [block_key(f"g1-{i}") for i in range(3)]
    blocks = pool.get_new_blocks(4)
    for key, block in zip(chain, blocks):
        pool.cached_block_hash_to_block.insert(key, block)
    pool.cached_block_hash_to_block.insert(chain[0], blocks[3])  # a duplicate of block 0
    probe = g1_probe(pool)
    assert probe(chain + [block_key("never")]) == [1, 1, 1, 0]

    idx = SessionPrefixIndex(g1_probe=probe)
    idx.admit("s", chain, Tier.G1)
    assert idx.resolve_session("s").per_tier[Tier.G1] == chain
    pool.cached_block_hash_to_block.pop(chain[2], blocks[2].block_id)  # vLLM evicted it
    idx.sweep_g1()
    assert chain[2] not in idx and idx.frontiers("s") == [chain[1]]

    pool.free_blocks(blocks)  # nothing in use: the reset may clear the map
    assert pool.reset_prefix_cache()
    assert probe(chain) == [0, 0, 0]  # the probe reads the new map
    idx.sweep_g1()
    assert len(idx) == 0 and idx.frontiers("s") == []
