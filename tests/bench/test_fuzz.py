"""The fuzz suite stays: every target of bench/fuzz.py runs a few hundred
examples in CI with no unexpected exception (bench/README has the 100,000-
example run)."""

import json

import fuzz


def test_every_target_runs_clean(tmp_path):
    out = tmp_path / "fuzz.json"
    rc = fuzz.main(["--examples", "200", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["targets"]) >= {
        "envelope",
        "kv_fetch",
        "sign_verify",
        "request_hints",
        "control_frames",
        "client_replies",
        "event_decoding",
        "router_config",
        "policy_config",
        "probe_replies",
        "metrics_text",
        "yaml_files",
        "router_handler",
    }
    bad = {k: v["first"] for k, v in result["targets"].items() if v["unexpected"]}
    assert rc == 0 and not bad, bad
    assert all(v["examples"] == 200 for v in result["targets"].values())


def test_the_fuzzer_finds_what_it_is_for():
    """A check that raises on a planted bug is counted, with the example."""
    from hypothesis import strategies as st

    def planted(s):
        if "\ud800" in s:
            raise TypeError("planted")

    r = fuzz.run_target(st.sampled_from(["ok", "a\ud800"]), planted, 50)
    assert r["unexpected"] > 0 and "planted" in r["first"]["error"]
