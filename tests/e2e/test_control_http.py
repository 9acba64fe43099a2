"""Two API servers on one machine, each with its control channel (in its
engine-core process), driven by the ``sessionkv`` command line."""

import json
import subprocess
import sys

import pytest
from test_hints_http import ARGS, PROMPTS, SECRET, complete

from sessionkv.devtools.engines import TINY, kv_transfer_config, new_engine_id
from sessionkv.devtools.server import ServerProcess, remove_offload_region


def start(d, name):
    engine_id = new_engine_id()
    cfg = kv_transfer_config(
        engine_id,
        sessionkv={
            "policy_file": str(d / "tiers.yaml"),
            "control": {"endpoint_file": str(d / f"{name}.json")},
        },
    )
    srv = ServerProcess(
        TINY,
        [*ARGS, "--kv-transfer-config", json.dumps(cfg)],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    return srv, engine_id


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("ctl")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(f"version: 1\ntrust:\n  secret_file: {d / 'secret'}\n")
    started = []
    try:
        for name in "ab":
            started.append(start(d, name))
        yield d, [s for s, _ in started]
    finally:
        for srv, engine_id in started:
            srv.stop()
            remove_offload_region(engine_id)


def cli(d, *args):
    """Run the CLI; (exit status, JSON lines printed)."""
    p = subprocess.run(
        [sys.executable, "-m", "sessionkv.cli", *args, "--secret-file", str(d / "secret")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, [json.loads(line) for line in p.stdout.splitlines()]


def test_two_servers_have_their_own_channels(servers):
    d, (a, b) = servers
    ea, eb = (json.loads((d / f"{n}.json").read_text()) for n in "ab")
    assert {ea["control"], ea["events"]}.isdisjoint({eb["control"], eb["events"]})
    assert all(e["control"].startswith("tcp://127.0.0.1:") for e in (ea, eb))
    assert ea["engine_id"] != eb["engine_id"]


def test_cli_pins_on_one_server_and_reads_its_events(servers):
    d, (a, b) = servers
    complete(a, PROMPTS[2], "cli-session")
    rc, (out,) = cli(
        d,
        "hint",
        "pin",
        "--endpoint-file",
        str(d / "a.json"),
        "--session",
        "cli-session",
        "--ttl",
        "60",
    )
    assert (rc, out["status"], out["blocks_affected"]) == (0, "accepted", 3)
    rc, (out,) = cli(
        d,
        "hint",
        "pin",
        "--endpoint-file",
        str(d / "b.json"),
        "--session",
        "cli-session",
        "--ttl",
        "60",
    )
    assert (rc, out["status"], out["reason"]) == (1, "missing", "unknown session")
    rc, (out,) = cli(
        d, "hint", "end-session", "--endpoint-file", str(d / "a.json"), "--session", "cli-session"
    )
    assert (rc, out["status"]) == (0, "accepted")
    rc, events = cli(
        d,
        "events",
        "--endpoint-file",
        str(d / "a.json"),
        "--after",
        "0",
        "--idle-timeout",
        "1",
        "--kinds",
        "association",
        "outcome",
    )
    assert rc == 0 and [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    mine = [
        (e["kind"], e.get("op") or e["outcome"]["status"])
        for e in events
        if e.get("session_id") == "cli-session"
    ]
    assert mine[-3:] == [("outcome", "accepted"), ("association", "end"), ("outcome", "accepted")]
    assert ("association", "extend") in mine
    # Another secret: exit status 2, nothing printed.
    (d / "wrong").write_bytes(b"x" * 32)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessionkv.cli",
            "hint",
            "pin",
            "--endpoint-file",
            str(d / "a.json"),
            "--session",
            "s",
            "--secret-file",
            str(d / "wrong"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (p.returncode, p.stdout) == (2, "") and "not authentic" in p.stderr
