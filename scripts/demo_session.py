"""The demo: one agent session whose earlier turns leave G1, served back from G2.

Starts vLLM's OpenAI server (realistic-shape local model) with SessionTierConnector,
runs a multi-turn session in which every turn ends in a tool-call gap that drops
G1 (``/reset_prefix_cache``, dev mode), and prints per turn where the prompt's KV
came from and the TTFT. Then it times the final prompt recomputed (G1 and G2
emptied) against served from G2 (G1 emptied), and checks that both give the same
greedy tokens and logprobs.

    scripts/demo [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import requests

from sessionkv.report import RequestReport
from sessionkv.devtools.server import ServerProcess, remove_offload_region

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / ".cache" / "models" / "realistic")
BLOCK = 32
SESSION = f"demo-{uuid.uuid4().hex[:8]}"
TURNS = [(1536, 48), (384, 48), (256, 48), (320, 1)]   # (new user tokens, reply tokens)


def completion(srv: ServerProcess, prompt: list[int], max_tokens: int) -> tuple[dict, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 5, "session_id": SESSION}
    t0 = time.perf_counter()
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), elapsed


def ttft(srv: ServerProcess, prompt: list[int]) -> tuple[float, RequestReport, dict]:
    """Time to first token: a non-streaming request for one token (the report
    comes back only on non-streaming responses)."""
    out, elapsed = completion(srv, prompt, 1)
    return elapsed, RequestReport.from_params(out["kv_transfer_params"]), out


def reply_tokens(out: dict) -> list[int]:
    # Token ids of the reply, for the next turn's prompt ("token_id:N" strings).
    return [int(t.split(":", 1)[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


def run_session(server_args: list[str], env: dict[str, str]) -> dict:
    """Run the session and the measurements against a fresh server; the summary."""
    rng = np.random.default_rng(0)
    with ServerProcess(MODEL, server_args, env=env) as srv:
        prompt: list[int] = []
        turns = []
        print(f"\nsession {SESSION}: every turn ends in a tool call; the gap drops G1\n")
        print(f"{'turn':>4} {'prompt':>7} {'from G1':>8} {'from G2':>8} {'recomputed':>11} {'TTFT s':>8}")
        for i, (new_tokens, reply_len) in enumerate(TURNS, 1):
            prompt = prompt + rng.integers(10, 4000, new_tokens).tolist()
            t, rep, out = ttft(srv, prompt)
            print(f"{i:>4} {rep.prompt_tokens:>7} {rep.tokens.g1:>8} {rep.tokens.g2:>8} "
                  f"{rep.tokens.recomputed:>11} {t:>8.3f}", flush=True)
            turns.append({"turn": i, "ttft_s": t, **msgspec.to_builtins(rep)})
            if reply_len > 1:
                out, _ = completion(srv, prompt, reply_len)
                prompt = prompt + reply_tokens(out)
            srv.post("/reset_prefix_cache")             # the tool-call gap: G1 is lost

        # Recompute vs G2 on the final prompt, alternating, median of three each.
        cold_t, g2_t, g2_blocks = [], [], 0
        for _ in range(3):
            srv.post("/reset_prefix_cache?reset_external=true")
            t, rep, _ = ttft(srv, prompt)
            assert rep.tokens.recomputed == rep.prompt_tokens, rep
            cold_t.append(t)
            srv.post("/reset_prefix_cache")
            t, rep, _ = ttft(srv, prompt)
            g2_t.append(t)
            g2_blocks = rep.blocks.g2
        # Correctness, 16 greedy tokens with logprobs: served from G2 against a
        # cold recompute (tokens) and against vLLM's own G1 prefix hit of the
        # same length (tokens and logprobs, bit for bit: the same KV bytes and
        # the same suffix computation). A full prefill and a prefix hit run
        # different kernel shapes, so their logprobs may differ in the last bits.
        srv.post("/reset_prefix_cache?reset_external=true")
        cold, _ = completion(srv, prompt, 16)
        from_g1, _ = completion(srv, prompt, 16)
        srv.post("/reset_prefix_cache")
        from_g2, _ = completion(srv, prompt, 16)
        lp = lambda o: o["choices"][0]["logprobs"]  # noqa: E731
        g1_rep = RequestReport.from_params(from_g1["kv_transfer_params"])
        g2_rep = RequestReport.from_params(from_g2["kv_transfer_params"])
        assert g1_rep.blocks.g1 == g2_rep.blocks.g2 > 0, (g1_rep, g2_rep)
        tokens_equal_cold = lp(cold)["tokens"] == lp(from_g2)["tokens"]
        logprobs_equal_g1 = lp(from_g1) == lp(from_g2)
        max_diff_cold = max(abs(a - b) for a, b in zip(lp(cold)["token_logprobs"],
                                                      lp(from_g2)["token_logprobs"]))
        outputs_equal = tokens_equal_cold and logprobs_equal_g1

    return {
        "model": "realistic (hidden 768, 8 layers, float32, random weights)",
        "prompt_tokens": len(prompt),
        "ttft_recompute_s": statistics.median(cold_t),
        "ttft_from_g2_s": statistics.median(g2_t),
        "ttft_ratio": statistics.median(g2_t) / statistics.median(cold_t),
        "blocks_from_g2": g2_blocks,
        "outputs_equal": outputs_equal,
        "tokens_equal_cold_recompute": tokens_equal_cold,
        "logprobs_equal_g1_hit": logprobs_equal_g1,
        "logprobs_max_abs_diff_cold_recompute": max_diff_cold,
        "turns": turns,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()

    engine_id = f"demo-{uuid.uuid4().hex[:8]}"
    # One trusted user and no router: per-tier counts for every request.
    policy = Path(tempfile.mkdtemp(prefix="sessionkv-demo-")) / "tiers.yaml"
    policy.write_text("version: 1\nreport: {per_tier: all}\n")
    kv = {"kv_connector": "SessionTierConnector",
          "kv_connector_module_path": "sessionkv.connectors.vllm", "kv_role": "kv_both",
          "engine_id": engine_id,
          "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30,
                                        "sessionkv": {"policy_file": str(policy)}}}
    server_args = ["--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "4096",
                   "--dtype", "float32", "--seed", "0", "--return-tokens-as-token-ids",
                   "--max-num-batched-tokens", "8192",
                   "--kv-transfer-config", json.dumps(kv)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    print("starting vLLM (realistic-shape model) with SessionTierConnector ...", flush=True)
    try:
        summary = run_session(server_args, env)
    finally:
        remove_offload_region(engine_id)
    s = summary
    print(f"\nfinal prompt, {s['prompt_tokens']} tokens: TTFT recomputed {s['ttft_recompute_s']:.3f} s,"
          f" from G2 {s['ttft_from_g2_s']:.3f} s ({s['blocks_from_g2']} blocks);"
          f" ratio {s['ttft_ratio']:.3f}")
    print(f"16 greedy tokens from G2 equal the cold recompute: {s['tokens_equal_cold_recompute']}"
          f" (logprobs within {s['logprobs_max_abs_diff_cold_recompute']:.1e})")
    print(f"tokens and logprobs from G2 equal vLLM's own G1 prefix hit, bit for bit: "
          f"{s['logprobs_equal_g1_hit']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"summary written to {args.json}")
    return 0 if s['outputs_equal'] else 1


if __name__ == "__main__":
    sys.exit(main())
