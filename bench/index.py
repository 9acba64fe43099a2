"""SessionPrefixIndex throughput and memory.

    python bench/index.py --blocks 1000000 --json OUT

Workload: sessions of 512-block chains sharing a 16-block system prompt, admitted
one request at a time (the batch a prefill admits), then hit again by other
sessions (membership from cache hits), resolved, and finally evicted chain by
chain (retreat and prune). Each figure is blocks per second of that operation.
``bytes_per_node`` is the memory the index holds per node, its key bytes
included, measured with tracemalloc in a separate, untimed pass. Both
indexes keep the alias map from the start (``with_aliases``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np

from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.types import Tier

CHAIN = 512
SHARED = 16


def make_chains(n_blocks: int) -> list[list[bytes]]:
    raw = np.random.default_rng(0).bytes(32 * n_blocks)
    group = bytes(4)
    keys = [raw[i * 32 : (i + 1) * 32] + group for i in range(n_blocks)]
    prompt = keys[:SHARED]
    rest = keys[SHARED:]
    step = CHAIN - SHARED
    return [prompt + rest[i : i + step] for i in range(0, len(rest) - step + 1, step)]


def admit_all(idx: SessionPrefixIndex, chains: list[list[bytes]]) -> int:
    for i, chain in enumerate(chains):
        idx.admit(f"s{i}", chain, Tier.G1, start=SHARED if i else 0)
    return len(idx)


def with_aliases(idx: SessionPrefixIndex) -> SessionPrefixIndex:
    """``idx`` keeping its alias map from the start, as an engine does once
    its control channel has answered a ``resolve``: admission's worst case,
    and the memory with the map included."""
    idx.build_aliases()
    return idx


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    chains = make_chains(args.blocks)
    admitted = sum(len(c) for c in chains) - SHARED * (len(chains) - 1)

    # Memory: untimed pass under tracemalloc; keys are created inside it so
    # that the bytes objects the index keeps alive are counted.
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    mem_chains = make_chains(args.blocks)
    mem_idx = with_aliases(SessionPrefixIndex(initial_capacity=1024))
    admit_all(mem_idx, mem_chains)
    del mem_chains
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    nodes = len(mem_idx)
    del mem_idx
    gc.collect()

    idx = with_aliases(SessionPrefixIndex(initial_capacity=1024))
    t_admit = timed(lambda: admit_all(idx, chains))
    assert len(idx) == admitted, (len(idx), admitted)

    def hits():
        for i, chain in enumerate(chains):
            idx.admit(f"h{i}", chain, None)

    t_hit = timed(hits)

    resolved = 0

    def resolve():
        nonlocal resolved
        for i in range(len(chains)):
            resolved += len(idx.resolve_session(f"s{i}").keys)

    t_resolve = timed(resolve)

    # The connector's per-step G1 sweep: 256 nodes re-read through a probe
    # that answers from a dict, as vLLM's block pool map does.
    pool = dict.fromkeys((k for c in chains for k in c), 1)
    idx.bind_g1_probe(lambda keys: [pool.get(k, 0) for k in keys])
    sweeps = 200
    t_sweep = timed(lambda: [idx.sweep_g1(256) for _ in range(sweeps)])
    idx.bind_g1_probe(None)

    def remove():
        for chain in chains:
            idx.set_copies(Tier.G1, chain[SHARED:], 0)

    t_remove = timed(remove)
    assert len(idx) == SHARED, len(idx)

    removed = admitted - SHARED
    out = {
        "blocks": admitted,
        "chain_blocks": CHAIN,
        "admit_ops_per_s": admitted / t_admit,
        "hit_ops_per_s": admitted / t_hit,
        "resolve_ops_per_s": resolved / t_resolve,
        "resolve_calls_per_s": len(chains) / t_resolve,
        "remove_ops_per_s": removed / t_remove,
        "bytes_per_node": used / nodes,
    }
    out["sweep_256_ms"] = t_sweep / sweeps * 1e3
    # Per scheduler step: ~500 block operations (admissions and hits, at the
    # slower rate) plus one G1 sweep; against a 50 ms step.
    out["step_cost_ms"] = (
        500 / min(out["admit_ops_per_s"], out["hit_ops_per_s"]) * 1e3 + out["sweep_256_ms"]
    )
    out["step_cost_pct_of_50ms"] = out["step_cost_ms"] / 50 * 100
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
