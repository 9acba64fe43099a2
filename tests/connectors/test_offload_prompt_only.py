"""Issue 52, "Defaults that amplify traffic": the connector set vLLM's
``offload_prompt_only`` to false, so every generated block went to G2 and
down to G3, though a reasoning model's next turn (whose chat template drops
the reasoning) never reads it. The default is vLLM's again: a turn stores
its prompt's chunks, and its output's once the next turn's prompt carries
them (bench/results/2026-12-07-offload-defaults.md); a user's setting
still wins.

A real vLLM ``Scheduler`` (no model: ``bench/scale_steps.py`` makes one
token a step) with SessionTierConnector built from ``--kv-transfer-config``,
on the vLLM this process runs (0.32 and 0.33)."""

import time

import pytest
import scale_steps as steps
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

from sessionkv.connectors.startup import bind_spec
from sessionkv.events import Outcome
from sessionkv.hints import sign
from sessionkv.types import Tier

PROMPT = 4 * steps.BLOCK + 3  # 4 full blocks
OUTPUT = 2 * steps.BLOCK  # the turn ends 99 tokens in: 6 full blocks committed
USER = steps.BLOCK
SECRET = b"offload-defaults-secret-0123456789abcdef"


def make(policy_file=None, **extra):
    init_none_hash(sha256)
    return steps.make_scheduler(
        True,
        steps.StepSpec(context=PROMPT, running=2, g2_chunks=64),
        policy_file,
        extra_config=extra,
    )


def turn(sched, rid, prompt, pin=False):
    """One request of session ``s`` (carrying a signed Pin with ``pin``)
    until it finished and its stores ended: its prompt plus the tokens it
    generated (7s)."""
    req = steps.session_request(rid, prompt, "s", OUTPUT)
    if pin:
        env = {
            "protocol_version": "1.0",
            "message_id": rid,
            "actions": [
                {
                    "action_id": "p",
                    "action_type": "kv.pin",
                    "action_version": "1.0",
                    "payload": {"ttl_s": 300},
                }
            ],
        }
        req.kv_transfer_params.update(kv_hints=env, kv_hints_sig=sign(env, "s", SECRET))
    sched.add_request(req)
    pending: set[int] = set()
    until = time.monotonic() + 30
    while sched.has_requests() or pending:
        assert time.monotonic() < until
        out = sched.schedule()
        meta = out.kv_connector_metadata
        sched.update_from_output(out, steps.model_output(out, pending))
        pending = set(getattr(meta, "load_jobs", ())) | set(getattr(meta, "store_jobs", ()))
    return prompt + [7] * OUTPUT


def in_g2(sched) -> int:
    manager = sched.connector.manager
    with manager.lock:
        return len(manager.index.resolve_session("s").per_tier[Tier.G2])


def test_the_connector_leaves_offload_prompt_only_to_vllm():
    extra = {"cpu_bytes_to_use": 1 << 20}
    bind_spec(extra)
    assert "offload_prompt_only" not in extra  # vLLM's default: true


def test_by_default_a_turn_stores_its_prompt_and_the_next_turn_its_output():
    sched = make(offload_prompt_only=None)  # the key not given
    try:
        assert sched.connector.connector_scheduler.config.offload_prompt_only is True
        first = list(range(1, PROMPT + 1))
        seen = turn(sched, "t1", first)
        assert in_g2(sched) == 4  # the prompt's blocks only
        second = seen + list(range(5000, 5000 + USER))  # 99 + 16 = 115 tokens: 7 blocks
        turn(sched, "t2", second)
        # Turn 2 stored its prompt: turn 1's output included; not its own.
        assert in_g2(sched) == len(second) // steps.BLOCK
    finally:
        sched.shutdown()


@pytest.mark.parametrize("prompt_only,stored", [(False, 6), (True, 4)])
def test_the_users_setting_wins(prompt_only, stored):
    sched = make(offload_prompt_only=prompt_only)
    try:
        turn(sched, "t1", list(range(1, PROMPT + 1)))
        assert in_g2(sched) == stored
    finally:
        sched.shutdown()


def test_a_turns_pin_covers_what_vllm_stores_of_it(tmp_path):
    # Prompt only, a turn's output is never stored with it: its hints must
    # not wait for those chunks (they came back clipped: "not stored in G2").
    (tmp_path / "secret").write_bytes(SECRET)
    policy = tmp_path / "tiers.yaml"
    policy.write_text(
        "limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
        f"trust: {{secret_file: {tmp_path / 'secret'}}}\n"
    )
    sched = make(str(policy), offload_prompt_only=None)
    try:
        manager = sched.connector.manager
        turn(sched, "t1", list(range(1, PROMPT + 1)), pin=True)
        for _ in range(5):  # idle steps: nothing is left to arrive
            out = sched.schedule()
            sched.update_from_output(out, steps.model_output(out, set()))
        outcomes = [
            (e.via, e.outcome.status, e.outcome.blocks_affected)
            for e in manager.event_log.since(0, 1 << 20)[0]
            if isinstance(e, Outcome)
        ]
        assert outcomes == [("request", "accepted", 4)]
        with manager.lock:
            assert (
                manager.service.executor.pinned_chunks == 4 and not manager.service.executor.waiting
            )
    finally:
        sched.shutdown()
