"""Which generated blocks to offload by default: bytes written to G2 and G3
per turn and the next turn's prompt by source, with vLLM's
``offload_prompt_only`` false and true, for outputs the next turn reuses and
outputs it drops.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python bench/offload_defaults.py --json OUT

A real engine per configuration (``.cache/models/tiny``, in-process, greedy,
``ignore_eos``) with SessionTierConnector, G2 and a disk G3 written through
(``g3.write_through``). ``--sessions`` sessions take turns round-robin,
``--turns`` turns each. Turn 1's prompt is ``--first`` random tokens; each
turn generates ``--output`` tokens; the next prompt is the previous prompt,
what the template keeps of the output, and ``--user`` new tokens.
Templates:

- ``chat``: the next prompt keeps the whole output (plain chat, agents'
  tool calls);
- ``reasoning``: it keeps only the last ``--answer`` tokens of the output
  (a reasoning model whose chat template drops the reasoning).

G1 between turns: ``evicted`` (``reset_prefix_cache()`` before every turn:
a busy engine's G1 turned over while the session waited) or ``kept`` (G1
large enough for every session).

Per configuration (JSON ``runs``): per turn and in total, G1 -> G2 and
G2 -> G3 bytes (the connector's ``sessionkv:moved_bytes``, read by wrapping
its stats), and the prompt tokens of turns 2.. by source (the request
report: g1, g2, g3, recomputed).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np

from sessionkv.devtools.engines import (
    kv_transfer_config,
    new_engine_id,
    serve,
    tiny_llm,
    use_engine_env,
)
from sessionkv.devtools.server import remove_offload_region

BLOCK = 32
KV_BYTES_PER_TOKEN = 2 * 2 * 128 * 4  # tiny: layers x (K, V) x hidden x float32


def moved_counter(manager) -> dict[tuple[str, str], int]:
    """Bytes the connector counted moved since start, by (src, dst): its
    stats' ``take`` (vLLM calls it every step) is wrapped to add them up."""
    total: dict[tuple[str, str], int] = {}
    take = manager.stats.take

    def counting(*args, **kwargs):
        stats = take(*args, **kwargs)
        data = stats.data.get("data", {}) if hasattr(stats, "data") else {}
        for labels, value in data.get("sessionkv:moved_bytes", {}).items():
            pair = tuple(labels)
            total[pair] = total.get(pair, 0) + int(value)
        return stats

    manager.stats.take = counting
    return total


def run(offload_prompt_only: bool, template: str, g1: str, args, tmp: Path) -> dict:
    from vllm import SamplingParams

    engine_id = new_engine_id()
    policy = tmp / f"{engine_id}.yaml"
    policy.write_text("report: {per_tier: all}\ng3: {write_through: true}\n")
    g3_dir = tmp / f"{engine_id}-g3"
    extra = {
        "block_size": BLOCK,
        "offload_prompt_only": offload_prompt_only,
        "secondary_tiers": [
            {
                "type": "DiskTier",
                "module_path": "sessionkv.tiers.g3.backends.disk",
                "path": str(g3_dir),
                "max_bytes": 1 << 30,
            }
        ],
        "sessionkv": {"policy_file": str(policy)},
    }
    llm = tiny_llm(
        kv_transfer_config(engine_id, cpu_bytes=args.g2_mib << 20, **extra),
        poison=False,
        block_size=BLOCK,
        max_model_len=4096,
    )
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        manager = sched.connector.manager
        moved = moved_counter(manager)
        params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
        rng = np.random.default_rng(0)
        prompts = {s: rng.integers(10, 4000, args.first).tolist() for s in range(args.sessions)}
        turns = []
        for turn in range(args.turns):
            before = dict(moved)
            sources = {"g1": 0, "g2": 0, "g3": 0, "recomputed": 0}
            prompt_tokens = 0
            for s in range(args.sessions):
                if g1 == "evicted":
                    assert llm.reset_prefix_cache()
                tokens, _, report = serve(llm, prompts[s], params, session=f"s{s}")
                prompt_tokens += len(prompts[s])
                for k in sources:
                    sources[k] += getattr(report.tokens, k)
                kept = tokens if template == "chat" else tokens[-args.answer :]
                prompts[s] = prompts[s] + kept + rng.integers(10, 4000, args.user).tolist()
            # The last turn's cascades end on the tier's threads: wait for them.
            until = time.monotonic() + 30
            while manager.has_pending_work() and time.monotonic() < until:
                time.sleep(0.05)
                llm.llm_engine.step()
            delta = {
                f"{src}->{dst}": moved.get((src, dst), 0) - before.get((src, dst), 0)
                for src, dst in (("G1", "G2"), ("G2", "G3"))
            }
            turns.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": prompt_tokens,
                    "bytes": delta,
                    "sources": sources,
                }
            )
        total = {k: sum(t["bytes"][k] for t in turns) for k in ("G1->G2", "G2->G3")}
        later = {k: sum(t["sources"][k] for t in turns[1:]) for k in turns[0]["sources"]}
        g3_files = sum(f.stat().st_size for f in g3_dir.rglob("*") if f.is_file())
        return {
            "offload_prompt_only": offload_prompt_only,
            "template": template,
            "g1": g1,
            "turns": turns,
            "bytes": total,
            "g3_dir_bytes": g3_files,
            "later_turns_sources": later,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        remove_offload_region(engine_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--user", type=int, default=64)
    p.add_argument("--g2-mib", type=int, default=64)
    p.add_argument("--g1", default="evicted,kept")
    args = p.parse_args()
    use_engine_env()
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for g1 in args.g1.split(","):
            for template in ("chat", "reasoning"):
                for prompt_only in (False, True):
                    t0 = time.monotonic()
                    r = run(prompt_only, template, g1, args, Path(d))
                    r["seconds"] = round(time.monotonic() - t0, 1)
                    runs.append(r)
                    print(
                        json.dumps(
                            {
                                k: r[k]
                                for k in (
                                    "g1",
                                    "template",
                                    "offload_prompt_only",
                                    "bytes",
                                    "later_turns_sources",
                                    "seconds",
                                )
                            }
                        ),
                        flush=True,
                    )
    out = {"args": vars(args), "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "runs": runs}
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
