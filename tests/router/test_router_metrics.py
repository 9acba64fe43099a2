"""The router's ``/metrics`` text: every counter ``/router/status`` reports,
in Prometheus's format, read back with prometheus-client's own parser. The
router here is its counters and two workers' state (the whole router on
real engines: tests/e2e/test_router.py)."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from sessionkv.hints import HintOutcome, Status
from sessionkv.router.metrics import Counters, RouterMetrics


def test_metrics_render_the_counters_and_workers():
    counters = Counters()
    workers = {
        "a": SimpleNamespace(healthy=True, load=2.0, inflight=1),
        "b": SimpleNamespace(healthy=False, load=0.0, inflight=0),
    }
    metrics = RouterMetrics(SimpleNamespace(counters=counters, workers=workers))
    counters.request("a", 200)
    counters.request("a", 200)
    counters.request("b", "error")
    counters.sent("request", 1)
    counters.sent("control", 2)
    counters.event("moves")
    counters.outcome(HintOutcome("h1", "kv.pin", Status.ACCEPTED), "control")
    counters.outcome(HintOutcome("h2", "kv.share", Status.DEFERRED), "control")
    metrics.ttft("a", 0.02)
    metrics.ttft("a", 3.0)
    body, ctype = metrics.render()
    assert ctype.startswith("text/plain")
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert got[("sessionkv_router_requests_total", (("status", "200"), ("worker", "a")))] == 2
    assert got[("sessionkv_router_requests_total", (("status", "error"), ("worker", "b")))] == 1
    assert got[("sessionkv_router_hints_sent_total", (("via", "control"),))] == 2
    assert got[("sessionkv_router_events_total", (("event", "moves"),))] == 1
    assert (
        got[
            (
                "sessionkv_router_hint_outcomes_total",
                (("action", "share"), ("status", "deferred"), ("via", "control")),
            )
        ]
        == 1
    )
    assert got[("sessionkv_router_ttft_seconds_count", (("worker", "a"),))] == 2
    assert got[("sessionkv_router_ttft_seconds_bucket", (("le", "0.025"), ("worker", "a")))] == 1
    assert got[("sessionkv_router_worker_healthy", (("worker", "b"),))] == 0
    assert got[("sessionkv_router_worker_load", (("worker", "a"),))] == 2.0
    assert counters.to_dict()["requests"] == {"a": {"200": 2}, "b": {"error": 1}}
