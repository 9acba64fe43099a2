"""Test-only vLLM worker extension: overwrite G1 blocks with garbage.

Freed G1 blocks keep the KV they last held, so a worker that loaded nothing
would still produce the right output. Tests poison the blocks a load must
overwrite; if the load read the wrong place (or nothing), the output changes.
Loaded with ``worker_extension_cls="sessionkv.devtools.kvpoison.KVPoisonExtension"``
(``devtools.engines.POISON_EXT``); arguments are strings so that the dev-mode
HTTP ``/collective_rpc`` endpoint can call it too.
"""

import json
from typing import Any

import torch
from vllm.v1.kv_cache_interface import group_kernel_blocks


class KVPoisonExtension:
    model_runner: Any  # the vLLM worker's, which this class extends

    def poison_kv(self, block_ids: str = "null", seed: str = "0") -> int:
        """Fill the given G1 blocks (JSON list; null = all) of every layer with
        seeded random values. Returns how many blocks were poisoned."""
        ids = json.loads(block_ids)
        runner = self.model_runner
        num_blocks = runner.kv_cache_config.num_blocks
        gen = torch.Generator().manual_seed(int(seed))
        idx = None if ids is None else torch.tensor(ids, dtype=torch.long)
        for cache in runner.kv_caches:
            view = group_kernel_blocks(cache, num_blocks)
            shape = view.shape if idx is None else (len(ids), *view.shape[1:])
            # Finite garbage: attention kernels may multiply masked-out slots
            # by zero, and NaN there would break even a correct load.
            noise = (torch.randn(shape, generator=gen) * 3).to(view.dtype)
            if idx is None:
                view.copy_(noise)
            else:
                view[idx] = noise
        return num_blocks if idx is None else len(ids)
