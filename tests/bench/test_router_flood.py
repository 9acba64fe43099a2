"""bench/router_flood.py runs (a small flood) and writes its keys; the goals
themselves are checked by the bench's full run (bench/README.md), not here."""

import json

import pytest
import router_flood


def test_a_small_router_flood_writes_every_key(tmp_path):
    out = tmp_path / "flood.json"
    assert (
        router_flood.main(
            ["--json", str(out), "--sessions", "200", "--bodies", "4", "--slow", "20"]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["router_requests"]["a"] == {"400": 200, "200": 4}  # the engine answered all
    assert doc["phases"]["slow_clients_held"] == 20  # before the header timeout
    assert doc["phases"]["slow_clients_closed"] == 20  # closed by the router after it
    for name in ("sessions", "bodies", "bodies_more", "slow_clients"):
        p = doc["phases"][name]
        assert p["rss_mib"] > 0 and p["s"] > 0
    phases = doc["phases"]
    assert phases["bodies_all"]["growth_mib"] == pytest.approx(
        phases["bodies"]["growth_mib"] + phases["bodies_more"]["growth_mib"], abs=0.11
    )
    assert doc["ok"] == all(
        phases[n]["growth_mib"] <= doc["goals"][f"{n}_growth_mib_max"]
        for n in ("sessions", "bodies_all", "slow_clients")
    )
