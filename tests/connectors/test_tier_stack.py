"""The tier stack from the policy file (``tiers:``) as vLLM builds the
connector: a real vLLM ``Scheduler`` (no model: ``bench/scale_steps.py``)
whose ``--kv-transfer-config`` names only the policy file and this engine's
``tier_options``; G2 gets the file's size, and a session's blocks reach the
file's Redis G3 tier, which carries the engine's option. (Parsing and its
errors: tests/sessionkv/test_config.py.)"""

import time

import redis
import scale_steps as steps
from test_step_lock import PROMPT_BLOCKS, request, run_until_idle
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

from sessionkv.tiers.g3.backends.redis import RedisTier
from sessionkv.types import Tier


def test_the_policy_files_tier_stack_builds_g2_and_g3(tmp_path, redis_url):
    init_none_hash(sha256)
    ns = f"stack-{time.monotonic_ns()}"
    policy = tmp_path / "tiers.yaml"
    policy.write_text(
        f"version: 1\ntiers:\n  g2_bytes: {48 * steps.CHUNK_BYTES}\n  g3:\n"
        f"    - {{type: RedisTier, namespace: {ns}, timeout_s: 10.0}}\n"
    )
    sched = steps.make_scheduler(
        True,
        steps.StepSpec(context=PROMPT_BLOCKS * steps.BLOCK, running=2, g2_chunks=64),
        extra_config={
            "cpu_bytes_to_use": None,
            "sessionkv": {
                "policy_file": str(policy),
                "tier_options": {"RedisTier": {"url": redis_url}},
            },
        },
    )
    try:
        manager = sched.connector.manager
        assert manager.primary_tier.num_chunks == 48  # the file's G2 size
        (g3,) = manager.secondary_tiers
        assert isinstance(g3, RedisTier)
        # KV events are off: vLLM's own events tracker is left as it is
        assert type(sched.connector.scheduler._events_tracker) is OffloadingEventsTracker
        sched.add_request(request("a", "s", 1))
        run_until_idle(sched, set())
        deadline = time.monotonic() + 30
        while True:  # the cascade to Redis runs on the tier's thread
            with manager.lock:
                in_g3 = manager.index.resolve_session("s").per_tier[Tier.G3]
            if len(in_g3) == PROMPT_BLOCKS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
            sched.schedule()
        assert len(in_g3) == PROMPT_BLOCKS
        # ... at this engine's tier_options URL.
        assert redis.Redis.from_url(redis_url).keys(f"{ns}*")
    finally:
        sched.shutdown()
