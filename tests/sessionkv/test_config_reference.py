"""Every configuration key the code reads appears in docs/reference/configuration.md's
configuration reference (engine side) or its Router section (``router.yaml``),
found by walking the code (config dataclasses, tier constructors), not a
hand-kept list."""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

from sessionkv.config import G3_MODULES, ControlConfig, SessionKVConfig, TierPolicy
from sessionkv.router.config import RedisConfig, RouterConfig, WorkerConfig
from sessionkv.tiers.g3.tier import G3Tier

README = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"
# G3Tier's constructor arguments that vLLM or sessionkv's spec pass, not the tier entry.
FROM_VLLM = {
    "self",
    "offloading_spec",
    "primary_kv_view",
    "tier_type",
    "backend",
    "backpressure_detector",
    "backend_config",
    "quarantine",
    "observer",
    "seal_key",
}
# Backend constructor arguments a tier wires itself (DiskTier: its evictor's callback).
WIRED = {"on_evict"}


def reference_keys() -> set[str]:
    """The first column of every table row in "## Configuration reference"."""
    text = README.read_text()
    section = text.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for row in re.findall(r"^\| `([^`]+)`(?: / `([^`]+)`)? \|", section, re.M):
        keys.update(k for k in row if k)
    return keys


def code_keys() -> set[str]:
    keys = {"version"}
    for section in dataclasses.fields(TierPolicy):
        for f in dataclasses.fields(
            section.type if isinstance(section.type, type) else section.default_factory
        ):
            if f.name != "secret":  # read from secret_file
                keys.add(f"{section.name}.{f.name}")
    keys |= {f"sessionkv.control.{f.name}" for f in dataclasses.fields(ControlConfig)}
    keys |= {
        f"sessionkv.{f.name}"
        for f in dataclasses.fields(SessionKVConfig)
        if f.name not in ("policy", "control")
    }
    keys.add("secondary_tiers")
    keys |= set(inspect.signature(G3Tier.__init__).parameters) - FROM_VLLM
    assert {"DiskTier", "MooncakeTier", "RedisTier", "LMCacheTier"} <= set(G3_MODULES)
    for kind, module in G3_MODULES.items():  # sessionkv's own tiers
        tier = getattr(importlib.import_module(module), kind)
        params = set(inspect.signature(tier.backend_class.__init__).parameters) - {"self"} - WIRED
        keys |= {f"{tier.__name__}.{p}" for p in params}
    return keys


def test_every_key_in_the_code_is_in_the_reference():
    missing = code_keys() - reference_keys()
    assert not missing, f"not in docs/reference/configuration.md: {sorted(missing)}"


def test_the_reference_names_no_key_the_code_does_not_read():
    vllm_keys = {"cpu_bytes_to_use", "block_size", "blocks_per_chunk", "offload_prompt_only"}
    unknown = reference_keys() - code_keys() - vllm_keys
    assert not unknown, f"in the reference but not read by the code: {sorted(unknown)}"


def router_keys(cls=RouterConfig, prefix="") -> set[str]:
    """``router.yaml``'s keys from its dataclasses (the YAML spells three of
    them differently: ``listen: {host, port}``, ``secret_file``)."""
    renamed = {"host": "listen.host", "port": "listen.port", "secret": "secret_file"}
    out = set()
    for f in dataclasses.fields(cls):
        name = renamed.get(f.name, f.name) if not prefix else f.name
        inner = f.default if dataclasses.is_dataclass(f.default) else None
        if inner is not None:
            out |= router_keys(type(inner), f"{prefix}{name}.")
        elif f.name == "workers":
            out |= router_keys(WorkerConfig, "workers[].")
        elif f.name == "redis":
            out |= router_keys(RedisConfig, "redis.")
        else:
            out.add(prefix + name)
    return out


def test_every_router_key_is_in_the_router_section():
    text = README.read_text()
    section = text.split("## Router", 1)[1].split("\n## ", 1)[0]
    yaml_block = section.split("```yaml", 1)[1].split("```", 1)[0]
    keys = router_keys()
    assert {
        "listen.port",
        "secret_file",
        "redis.url",
        "workers[].plain",
        "policy.tool_call.pin_ttl_factor",
        "routing.overlap_g2_weight",
    } <= keys
    missing = sorted(k for k in keys if k.rsplit(".", 1)[-1] + ":" not in yaml_block)
    assert not missing, (
        f"router.yaml keys not in the configuration reference's Router section: {missing}"
    )
