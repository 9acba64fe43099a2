"""Configuration: every bad value fails with a ValueError naming its key."""

import pytest

from sessionkv.config import (
    G2Policy,
    SessionKVConfig,
    SessionPolicy,
    TierPolicy,
    parse_extra_config,
)

BASE = {"cpu_bytes_to_use": 1 << 20}


def policy_file(tmp_path, text):
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_sessionkv_keys():
    assert parse_extra_config(BASE) == SessionKVConfig()


def test_policy_file_is_parsed(tmp_path):
    path = policy_file(tmp_path, "version: 1\ng2:\n  eviction: arc\n"
                                 "sessions: {idle_timeout_s: 30, max_tombstones: 5}\n")
    cfg = parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})
    assert cfg == SessionKVConfig(
        policy=TierPolicy(g2=G2Policy("arc"), sessions=SessionPolicy(30.0, 5)),
        policy_file=path)


def test_vllm_keys_pass_through():
    cfg = parse_extra_config({**BASE, "block_size": 64, "offload_prompt_only": True,
                              "secondary_tiers": []})
    assert cfg == SessionKVConfig()


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
        ("g3: {}\n", "g3"),
        ("version: 2\n", "version"),
        ("sessions: {idle_timeout_s: 0}\n", "sessions.idle_timeout_s"),
        ("sessions: {idle_timeout_s: forever}\n", "sessions.idle_timeout_s"),
        ("sessions: {max_tombstones: -1}\n", "sessions.max_tombstones"),
        ("sessions: {ttl: 5}\n", "ttl"),
        ("g2: [1, 2]\n", "g2"),
        ("- a\n- b\n", "must be a mapping"),
        ("g2: {eviction: [\n", "invalid YAML"),
    ],
)
def test_bad_policy_file_names_the_key(tmp_path, text, key):
    path = policy_file(tmp_path, text)
    with pytest.raises(ValueError, match=key) as err:
        parse_extra_config({**BASE, "sessionkv": {"policy_file": path}})
    assert path in str(err.value) or "policy_file" in str(err.value)
