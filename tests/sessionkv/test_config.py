"""Configuration: every bad value fails with a ValueError naming its key."""

import pytest

from sessionkv.config import (
    G2Policy,
    Limits,
    SessionKVConfig,
    SessionPolicy,
    TierPolicy,
    parse_extra_config,
    vllm_extra_config,
)

BASE = {"cpu_bytes_to_use": 1 << 20}


def policy_file(tmp_path, text):
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_sessionkv_keys():
    assert parse_extra_config(BASE) == SessionKVConfig()


def test_policy_file_is_parsed(tmp_path):
    path = policy_file(
        tmp_path,
        "version: 1\ng2:\n  eviction: arc\nsessions: {idle_timeout_s: 30, max_tombstones: 5}\n",
    )
    cfg = parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})
    assert cfg == SessionKVConfig(
        policy=TierPolicy(g2=G2Policy("arc"), sessions=SessionPolicy(30.0, 5)), policy_file=path
    )


def test_vllm_keys_pass_through():
    cfg = parse_extra_config(
        {**BASE, "block_size": 64, "offload_prompt_only": True, "secondary_tiers": []}
    )
    assert cfg == SessionKVConfig()


def test_g3_write_through_defaults_on_and_can_be_turned_off(tmp_path):
    assert parse_extra_config(BASE).policy.g3.write_through is True  # vLLM's cascade
    path = policy_file(tmp_path, "g3: {write_through: false}\n")
    cfg = parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})
    assert cfg.policy.g3.write_through is False


def test_control_settings_are_parsed():
    from sessionkv.config import ControlConfig

    cfg = parse_extra_config(
        {**BASE, "sessionkv": {"control": {"port": 5700, "endpoint_file": "/tmp/e.json"}}}
    )
    assert cfg.control == ControlConfig(host="127.0.0.1", port=5700, endpoint_file="/tmp/e.json")
    assert parse_extra_config(BASE).control == ControlConfig()  # any free port, loopback


@pytest.mark.parametrize(
    "extra, key",
    [
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "1G"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
        ({**BASE, "block_size": 0}, "block_size"),
        ({**BASE, "blocks_per_chunk": -1}, "blocks_per_chunk"),
        ({**BASE, "eviction_policy": "lru"}, "eviction_policy"),
        ({**BASE, "sessionkv": {"polcy_file": "x.yaml"}}, "polcy_file"),
        ({**BASE, "sessionkv": ["policy_file"]}, "sessionkv"),
        ({**BASE, "sessionkv": {"policy_file": ""}}, "policy_file"),
        ({**BASE, "sessionkv": {"policy_file": "/nonexistent/tiers.yaml"}}, "policy_file"),
        ({**BASE, "sessionkv": {"control": {"port": 70000}}}, "control.port"),
        ({**BASE, "sessionkv": {"control": {"port": "5700"}}}, "control.port"),
        ({**BASE, "sessionkv": {"control": {"host": ""}}}, "control.host"),
        ({**BASE, "sessionkv": {"control": {"endpoint_file": 3}}}, "control.endpoint_file"),
        ({**BASE, "sessionkv": {"control": {"prot": 1}}}, "prot"),
    ],
)
def test_bad_config_names_the_key(extra, key):
    with pytest.raises(ValueError, match=key):
        parse_extra_config(extra)


@pytest.mark.parametrize(
    "text, key",
    [
        ("g2:\n  eviction: mru\n", "g2.eviction"),
        ("g2:\n  evict: lru\n", "evict"),
        ("g3: {write_through: maybe}\n", "g3.write_through"),
        ("g3: {write_thru: false}\n", "write_thru"),
        ("g3: [1]\n", "g3"),
        ("version: 2\n", "version"),
        ("sessions: {idle_timeout_s: 0}\n", "sessions.idle_timeout_s"),
        ("sessions: {idle_timeout_s: forever}\n", "sessions.idle_timeout_s"),
        ("sessions: {max_tombstones: -1}\n", "sessions.max_tombstones"),
        ("sessions: {ttl: 5}\n", "ttl"),
        ("limits: {max_ttl_s: 0}\n", "limits.max_ttl_s"),
        ("limits: {pin_fraction_session: 1.5}\n", "limits.pin_fraction_session"),
        ("limits: {unsigned_pin_fraction: -0.1}\n", "limits.unsigned_pin_fraction"),
        ("limits: {max_blocks_per_hint: 2.5}\n", "limits.max_blocks_per_hint"),
        ("limits: {hints_per_s: 5}\n", "hints_per_s"),
        ("trust: {secret_file: /nonexistent/secret}\n", "trust.secret_file"),
        ("trust: {secret: abc}\n", "secret"),
        ("report: {per_tier: some}\n", "report.per_tier"),
        ("report: {per_tier: [all]}\n", "report.per_tier"),
        ("report: {tiers: all}\n", "tiers"),
        ("g2: [1, 2]\n", "g2"),
        ("- a\n- b\n", "must be a mapping"),
        ("g2: {eviction: [\n", "invalid YAML"),
        ("limits: {max_ttl_s: .inf}\n", "limits.max_ttl_s"),  # was an OverflowError
        ("limits: {hints_per_s_per_client: .nan}\n", "limits.hints_per_s_per_client"),
        ("sessions: {idle_timeout_s: 1.0e+300}\n", "sessions.idle_timeout_s"),
        ("version: true\n", "version"),  # True == 1 passed
        ("g2: " + "[" * 2000 + "]" * 2000 + "\n", "nested too deep"),  # was a RecursionError
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                for p, n in zip("abcde", "bcdef")
            ),
            "aliases",
        ),  # a "billion laughs", 10**6 here
    ],
)
def test_bad_policy_file_names_the_key(tmp_path, text, key):
    path = policy_file(tmp_path, text)
    with pytest.raises(ValueError, match=key) as err:
        parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})
    assert path in str(err.value) or "policy_file" in str(err.value)


def test_limits_and_trust_are_parsed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123\n")
    path = policy_file(
        tmp_path,
        f"limits: {{max_ttl_s: 60, unsigned_pin_fraction: 0.02}}\n"
        f"trust: {{secret_file: {secret}}}\n",
    )
    policy = parse_extra_config({**BASE, "sessionkv": {"policy_file": path}}).policy
    assert (policy.limits.max_ttl_s, policy.limits.unsigned_pin_fraction) == (60.0, 0.02)
    assert policy.limits.max_blocks_per_hint == Limits().max_blocks_per_hint
    assert policy.trust.secret == b"0123456789abcdef0123"
    assert "0123456789" not in repr(policy.trust)  # never logged


def test_a_short_secret_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"short")
    path = policy_file(tmp_path, f"trust: {{secret_file: {secret}}}\n")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})


def test_per_tier_reports_default_to_signed_requests_only(tmp_path):
    assert parse_extra_config(BASE).policy.report.per_tier == "signed"
    path = policy_file(tmp_path, "report: {per_tier: all}\n")
    assert (
        parse_extra_config({**BASE, "sessionkv": {"policy_file": path}}).policy.report.per_tier
        == "all"
    )


# ---- the tier stack in the policy file (tiers:) ---------------------------

STACK = """version: 1
tiers:
  g2_bytes: 2097152
  g3:
    - {type: MooncakeTier, master: "127.0.0.1:50051", metadata_server: "http://m/metadata"}
    - {type: RedisTier, url: "redis://127.0.0.1:6379/0"}
    - {type: DiskTier, path: /var/cache/kv, max_bytes: 1048576}
    - {type: FancyTier, module_path: my.tiers, depth: 3}
"""


def test_the_policy_files_tier_stack_becomes_vllms_keys(tmp_path):
    path = policy_file(tmp_path, STACK)
    extra = {
        "sessionkv": {
            "policy_file": path,
            "tier_options": {"MooncakeTier": {"local_hostname": "10.0.0.5"}},
        },
        "block_size": 64,
    }
    cfg = parse_extra_config(extra)
    out = vllm_extra_config(extra, cfg)
    assert out["cpu_bytes_to_use"] == 2097152 and out["block_size"] == 64
    assert out["secondary_tiers"] == [
        {
            "type": "MooncakeTier",
            "module_path": "sessionkv.tiers.g3.backends.mooncake",
            "master": "127.0.0.1:50051",
            "metadata_server": "http://m/metadata",
            "local_hostname": "10.0.0.5",
        },  # this engine's option
        {
            "type": "RedisTier",
            "module_path": "sessionkv.tiers.g3.backends.redis",
            "url": "redis://127.0.0.1:6379/0",
        },
        {
            "type": "DiskTier",
            "module_path": "sessionkv.tiers.g3.backends.disk",
            "path": "/var/cache/kv",
            "max_bytes": 1048576,
        },
        {"type": "FancyTier", "module_path": "my.tiers", "depth": 3},
    ]
    assert "secondary_tiers" not in extra  # the caller's dict is kept


def test_without_a_stack_vllms_keys_pass_through(tmp_path):
    tiers = [{"type": "RedisTier", "module_path": "sessionkv.tiers.g3.backends.redis"}]
    extra = {**BASE, "secondary_tiers": tiers}
    assert vllm_extra_config(extra, parse_extra_config(extra)) == extra
    # G2's size per engine, the G3 tiers from the shared file: both allowed.
    path = policy_file(tmp_path, "tiers:\n  g3: [{type: RedisTier}]\n")
    extra = {**BASE, "sessionkv": {"policy_file": path}}
    out = vllm_extra_config(extra, parse_extra_config(extra))
    assert out["cpu_bytes_to_use"] == BASE["cpu_bytes_to_use"]
    assert out["secondary_tiers"] == [
        {"type": "RedisTier", "module_path": "sessionkv.tiers.g3.backends.redis"}
    ]


def test_a_g3_module_path_of_0_1_0_names_the_moved_backend(tmp_path):
    """0.1.0 kept the backends in ``sessionkv.tiers.<name>``: a policy file or a
    ``secondary_tiers`` entry naming that still finds the tier."""
    path = policy_file(
        tmp_path, "tiers:\n  g3: [{type: RedisTier, module_path: sessionkv.tiers.redis}]\n"
    )
    extra = {**BASE, "sessionkv": {"policy_file": path}}
    out = vllm_extra_config(extra, parse_extra_config(extra))
    assert out["secondary_tiers"][0]["module_path"] == "sessionkv.tiers.g3.backends.redis"
    old = [
        {"type": "DiskTier", "module_path": "sessionkv.tiers.disk", "path": "/x"},
        {"type": "FancyTier", "module_path": "my.tiers"},
    ]
    extra = {**BASE, "secondary_tiers": old}
    out = vllm_extra_config(extra, parse_extra_config(extra))
    assert out["secondary_tiers"] == [
        {"type": "DiskTier", "module_path": "sessionkv.tiers.g3.backends.disk", "path": "/x"},
        {"type": "FancyTier", "module_path": "my.tiers"},
    ]
    assert extra["secondary_tiers"][0]["module_path"] == "sessionkv.tiers.disk"  # kept


@pytest.mark.parametrize(
    "text, extra, key",
    [
        (STACK, {"cpu_bytes_to_use": 1 << 20}, "cpu_bytes_to_use and tiers.g2_bytes"),
        (STACK, {"secondary_tiers": []}, "secondary_tiers and tiers.g3.tier"),
        ("tiers: {g3: []}\n", {}, "cpu_bytes_to_use is required"),
        ("tiers: {g2_bytes: 0}\n", {}, "tiers.g2_bytes"),
        ("tiers: {g2_bytes: 1GiB}\n", {}, "tiers.g2_bytes"),
        ("tiers: {g2: 5}\n", BASE, "unknown key .*tiers.'g2'"),
        ("tiers: {g3: {type: RedisTier}}\n", BASE, "tiers.g3.tier must be a list"),
        ("tiers: {g3: [RedisTier]}\n", BASE, r"tiers.g3.tier\[0\]"),
        ("tiers: {g3: [{}]}\n", BASE, r"tiers.g3.tier\[0\] is empty"),
        ("tiers: {g3: [{url: x}]}\n", BASE, r"tiers.g3.tier\[0\].type"),
        (
            "tiers: {g3: [{type: RedisTier}, {type: FancyTier}]}\n",
            BASE,
            r"tiers.g3.tier\[1\].module_path",
        ),
        ("tiers: {g3: [{type: RedisTier, 3: x}]}\n", BASE, "keys must be strings"),
        ("tiers: [1]\n", BASE, "tiers must be a mapping"),
        (
            STACK,
            {"sessionkv": {"tier_options": {"LMCacheTier": {"url": "lm://x"}}}},
            "tier_options.LMCacheTier: no tier of that type",
        ),
        (
            STACK,
            {"sessionkv": {"tier_options": {"RedisTier": {"url": "redis://x"}}}},
            "tier_options.RedisTier.url is set in the policy file",
        ),
        (
            STACK,
            {"sessionkv": {"tier_options": {"RedisTier": "fast"}}},
            "tier_options.RedisTier must be a mapping",
        ),
        (
            "version: 1\n",
            {**BASE, "sessionkv": {"tier_options": {"RedisTier": {}}}},
            "tier_options sets options of the policy file's tiers.g3.tier, which has none",
        ),
    ],
)
def test_a_bad_tier_stack_names_the_key(tmp_path, text, extra, key):
    path = policy_file(tmp_path, text)
    extra = {**extra, "sessionkv": {**extra.get("sessionkv", {}), "policy_file": path}}
    with pytest.raises(ValueError, match=key):
        parse_extra_config(extra)
