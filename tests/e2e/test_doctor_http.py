"""``sessionkv doctor`` against real API servers: two that match pass; one
started with another PYTHONHASHSEED, one with another hash function (same
environment as the first) and a G3 tier that does not answer are named, each
with its fix."""

import json
import subprocess
import sys

import pytest
from test_hints_http import ARGS, SECRET

from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, free_port, remove_offload_region


@pytest.fixture(scope="module")
def servers(tmp_path_factory, redis_url):
    d = tmp_path_factory.mktemp("doctor")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(f"version: 1\ntrust:\n  secret_file: {d / 'secret'}\n")
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    specs = {
        "a": ("0", [], redis_url),
        "b": ("0", [], redis_url),
        "seed": ("1", [], redis_url),
        "algo": ("0", ["--prefix-caching-hash-algo", "xxhash"], redis_url),
        "g3down": ("0", [], dead),
    }
    started = {}
    try:
        for name, (seed, args, url) in specs.items():
            engine_id = new_engine_id()
            tier = {
                "type": "RedisTier",
                "module_path": "sessionkv.tiers.g3.backends.redis",
                "url": url,
                "namespace": "doctor",
                "timeout_s": 2.0,
            }
            cfg = kv_transfer_config(
                engine_id,
                secondary_tiers=[tier],
                sessionkv={
                    "policy_file": str(d / "tiers.yaml"),
                    "control": {"endpoint_file": str(d / f"{name}.json")},
                },
            )
            srv = ServerProcess(
                TINY,
                [*ARGS, *args, "--kv-transfer-config", json.dumps(cfg)],
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": seed},
            )
            started[name] = (srv, engine_id)
        yield d, {n: json.loads((d / f"{n}.json").read_text())["control"] for n in specs}
    finally:
        for srv, engine_id in started.values():
            srv.stop()
            remove_offload_region(engine_id)


def doctor(d, *engines):
    """(exit status, findings) of ``sessionkv doctor`` on those endpoints."""
    args = [a for e in engines for a in ("--engine", e)]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessionkv.cli",
            "doctor",
            *args,
            "--secret-file",
            str(d / "secret"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, [json.loads(line) for line in p.stdout.splitlines()]


def errors(findings):
    return [f for f in findings if f["level"] == "error"]


def test_two_matching_engines_pass(servers):
    d, ep = servers
    rc, found = doctor(d, ep["a"], ep["b"])
    assert rc == 0 and errors(found) == [], found
    assert [f["level"] for f in found] == ["ok"]


def test_another_pythonhashseed_is_named(servers):
    d, ep = servers
    rc, found = doctor(d, ep["a"], ep["seed"])
    (err,) = errors(found)
    assert rc == 1 and err["engine"] == ep["seed"]
    assert "PYTHONHASHSEED '1' != '0'" in err["what"] and "PYTHONHASHSEED" in err["fix"]


def test_another_hash_function_is_named_although_the_environment_matches(servers):
    d, ep = servers
    rc, found = doctor(d, ep["a"], ep["algo"])
    (err,) = errors(found)
    assert rc == 1 and err["engine"] == ep["algo"]
    assert "hash function xxhash != sha256" in err["what"]
    assert "--prefix-caching-hash-algo" in err["fix"]


def test_a_g3_tier_that_does_not_answer_is_named(servers):
    d, ep = servers
    rc, found = doctor(d, ep["a"], ep["g3down"])
    (err,) = errors(found)
    assert rc == 1 and err["engine"] == ep["g3down"]
    assert err["what"].startswith("G3 tier RedisTier does not answer")


def test_a_wrong_secret_is_named(servers, tmp_path):
    d, ep = servers
    (tmp_path / "secret").write_bytes(b"another-secret-0123456789abcdef")
    rc, found = doctor(tmp_path, ep["a"])
    (err,) = errors(found)
    assert rc == 1 and "did not authenticate" in err["what"]
