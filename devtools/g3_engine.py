"""One engine process for the G3 tests: serve prompts serially through a
SessionTierConnector with the given G3 tiers, then exit.

    python -m sessionkv.devtools.g3_engine SPEC_JSON OUT_JSON

SPEC: {"model", "block_size", "tiers", "prompts": [[token ids]...], "poison": bool,
"policy": YAML text of the tier policy (optional), "prefetch": {"keys": [hex],
"secret": hex, "wait": bool} (optional), "fetch": [{"id", "hashes": [64-bit
ints], "source": control endpoint, "secret": hex}] (optional), "await_stored":
bool (optional), "names_of": [[token ids]...] (optional: prompts not served)}.
With ``poison``, G1 and G2 are filled with garbage before the first request,
so chunks loaded from G3 must overwrite them. With ``prefetch`` (the policy
names the secret), a Prefetch of those chunk keys goes over the control
channel first, and with ``wait`` its final outcome is awaited. Each ``fetch``
is carried by a one-token request before the prompts.

OUT: {"runs": one {"tokens", "logprobs", "report", "objects", "g3_trips"} per
prompt (``objects``: the G3 data objects of its full blocks; ``g3_trips``: how
often the G3 tier's breaker had tripped by then), "prefetch": [first, final]
outcomes, "fetch": [first, final] outcomes per fetch, "stored_at_exit":
whether G3 holds every prompt's full blocks at the end (with
``await_stored``, after waiting up to 30 s for them), "names": the G3 data
objects each ``names_of`` prompt's full blocks would have}.
"""

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    from sessionkv.devtools.engines import (
        control_hint,
        kv_transfer_config,
        new_engine_id,
        poison_g2,
        serve,
        tiny_llm,
    )
    from sessionkv.devtools.keys import keys_of
    from sessionkv.devtools.server import remove_offload_region

    spec = json.load(open(spec_path))
    extra = {"secondary_tiers": spec["tiers"]}
    if spec.get("policy"):
        policy = f"{out_path}.policy.yaml"
        with open(policy, "w") as f:
            f.write(spec["policy"])
        extra["sessionkv"] = {"policy_file": policy}
    engine_id = new_engine_id()
    llm = tiny_llm(
        kv_transfer_config(engine_id, cpu_bytes=16 << 20, **extra),
        model=spec["model"],
        block_size=spec["block_size"],
    )
    try:
        if spec.get("poison"):
            (n,) = llm.collective_rpc("poison_kv", args=(json.dumps(None), "7"))
            assert n > 0
            poison_g2(engine_id, seed=7)
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        tier = connector.manager.secondary_tiers[0]
        out, prefetched = [], []
        if spec.get("prefetch"):
            from sessionkv.client import HintClient

            p = spec["prefetch"]
            with HintClient(connector.control.endpoint, bytes.fromhex(p["secret"])) as c:
                keys = [bytes.fromhex(k) for k in p["keys"]]
                if p["wait"]:
                    first, last, _ = control_hint(c, "prefetch", "b", keys=keys)
                else:
                    first = last = c.prefetch("b", keys=keys)
                prefetched = [[o.status, o.blocks_affected] for o in (first, last)]
        fetched = [fetch(llm, connector, f) for f in spec.get("fetch", ())]
        for prompt in spec["prompts"]:
            tok, lps, rep = serve(llm, prompt, params, session="g3")
            out.append(
                {
                    "tokens": tok,
                    "logprobs": [{str(k): v for k, v in s.items()} for s in lps],
                    "report": rep.to_params()["sessionkv"],
                    "objects": [tier.name(k) for k in keys_of(llm, prompt)],
                    "g3_trips": tier.guard.trips,
                }
            )

        def held() -> bool:
            return not tier.has_pending_work() and all(
                all(tier.listed(keys_of(llm, p))) for p in spec["prompts"]
            )

        # Held for a settling second: objects another writer planted are
        # listed before this engine's cascade replaces them, and vLLM submits
        # a cascade only some steps after the G2 store ends.
        deadline = time.monotonic() + (30 if spec.get("await_stored") else 0)
        settled = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            if not held():
                settled = None
            elif settled is None:
                settled = now
            elif now - settled >= 1.0:
                break
            llm.llm_engine.step()  # stores still running: let them end
            time.sleep(0.05)
        json.dump(
            {
                "runs": out,
                "prefetch": prefetched,
                "fetch": fetched,
                "stored_at_exit": held(),
                "names": [
                    [tier.name(k) for k in keys_of(llm, p)] for p in spec.get("names_of", ())
                ],
            },
            open(out_path, "w"),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        remove_offload_region(engine_id)


def fetch(llm, connector, f: dict) -> list:
    """A one-token request carrying KVCR's kv.fetch (signed), then the
    fetch's final outcome from this engine's event log: [[status,
    blocks_affected, reason] of the first outcome, of the final one]."""
    from vllm import SamplingParams

    from sessionkv.client import HintClient
    from sessionkv.devtools.engines import serve
    from sessionkv.hints import sign

    secret = bytes.fromhex(f["secret"])
    kvcr = {
        "protocol_version": "0.1",
        "message_id": f["id"],
        "actions": [
            {
                "action_type": "kv.fetch",
                "action_id": f["id"],
                "payload": {"source_control_endpoint": f["source"], "block_hashes": f["hashes"]},
            }
        ],
    }
    params = SamplingParams(
        temperature=0,
        max_tokens=1,
        extra_args={
            "kv_transfer_params": {"kv_hint": kvcr, "kv_hint_sig": sign(kvcr, "fetch", secret)}
        },
    )
    _, _, rep = serve(llm, [7, 8, 9], params, session="fetch")
    (first,) = rep.hints
    last = first
    if first.status == "deferred":
        with HintClient(connector.control.endpoint, secret) as c:
            last = c.final_outcome(first.hint_id, 0)
    return [[o.status, o.blocks_affected, o.reason] for o in (first, last)]


if __name__ == "__main__":
    from sessionkv.devtools.engines import use_engine_env

    use_engine_env()
    main(sys.argv[1], sys.argv[2])
