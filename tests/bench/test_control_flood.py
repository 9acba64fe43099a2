"""bench/control_flood.py runs (a small flood) and writes its keys; the goals
themselves are checked by the bench's full run (bench/README.md), not here."""

import json

import control_flood


def test_a_small_flood_run_writes_every_key(tmp_path):
    out = tmp_path / "flood.json"
    assert control_flood.main(["--json", str(out), "--pins", "10", "--peers", "6"]) == 0
    doc = json.loads(out.read_text())
    for phase in ("unloaded", "loaded"):
        assert doc[phase]["statuses"] == {"accepted": 10}  # every Pin served, none refused
        assert 0 < doc[phase]["p50_ms"] <= doc[phase]["p99_ms"]
    assert doc["flood_tcp_bytes"] > 0 and doc["zap_refused"] == 0
    assert doc["rss_growth_mib"] == doc["rss_peak_mib"] - doc["rss_before_mib"] >= 0
    assert doc["ok"] == (doc["rss_growth_mib"] <= 64 and doc["p50_ratio"] <= 2.0)
