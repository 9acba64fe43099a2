"""What the router counts (``Counters``: ``/router/status``) and its
Prometheus metrics (``GET /metrics``, as the engines serve theirs).
Everything ``/router/status`` counts comes from the same ``Counters``
(read at scrape time, so the two always agree), plus the workers' health and
load and a TTFT histogram per worker.

| metric | labels | what |
| --- | --- | --- |
| ``sessionkv_router_requests_total`` | worker, status | turns proxied (HTTP status, or ``error``) |
| ``sessionkv_router_ttft_seconds`` | worker | turn arrival to its first byte to the client (a histogram) |
| ``sessionkv_router_hint_outcomes_total`` | action, via, status | hint outcomes (via: request, control, policy, final) |
| ``sessionkv_router_hints_sent_total`` | via | hints sent: on requests, over the control channel, by the policy |
| ``sessionkv_router_events_total`` | event | moves, failover moves, new, refused and ended sessions, overlap scoring, retries, warm-ups, errors |
| ``sessionkv_router_prompt_blocks_total`` | tier | prompt blocks of finished turns by where the engine found them (g1, g2, g3, recomputed) |
| ``sessionkv_router_worker_healthy`` | worker | 1 while its ``/metrics`` answers |
| ``sessionkv_router_worker_load`` | worker | what routing compares (the engine's running and waiting, or the router's in-flight turns) |
| ``sessionkv_router_worker_inflight`` | worker | turns the router has on it now |

One registry per ``Router`` (tests run several in one process), none global.
Threading: the router's event loop; a scrape reads ``Counters`` under its lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sessionkv.hints import HintOutcome
from sessionkv.report import RequestReport

if TYPE_CHECKING:
    from sessionkv.router.app import Router

PREFIX = "sessionkv_router"
# Seconds: a G1 hit on a small model answers in milliseconds, a recomputed
# 64k-token prefill in tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Counters:
    """What the router did and what its hints became; thread-safe, JSON-ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: Counter[tuple[str, str, str]] = Counter()  # (action, status, via)
        self._blocks: Counter[str] = Counter()
        self._events: Counter[str] = Counter()
        self._requests: Counter[tuple[str, str]] = Counter()  # (worker, HTTP status)
        self._sent: Counter[str] = Counter()  # hints sent, by via

    def outcome(self, outcome: HintOutcome, via: str) -> None:
        action = (outcome.action or "?").removeprefix("kv.")
        with self._lock:
            self._outcomes[
                (action, str(getattr(outcome.status, "value", outcome.status)), via)
            ] += 1

    def report(self, report: RequestReport) -> None:
        with self._lock:
            self._events["reports"] += 1
            if report.blocks is None:  # the engine withheld them (report.per_tier)
                self._events["reports_without_tiers"] += 1
                return
            for tier in ("g1", "g2", "g3", "recomputed"):
                self._blocks[tier] += getattr(report.blocks, tier)

    def event(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._events[name] += n

    def request(self, worker: str, status: int | str) -> None:
        """A turn proxied to ``worker``: its HTTP status, or "error"."""
        with self._lock:
            self._requests[(worker, str(status))] += 1

    def sent(self, via: str, n: int = 1) -> None:
        """Hints sent: on a request, over the control channel, by the policy."""
        with self._lock:
            self._sent[via] += n

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            outcomes: dict[str, dict[str, dict[str, int]]] = {}
            for (action, status, via), n in sorted(self._outcomes.items()):
                outcomes.setdefault(action, {}).setdefault(via, {})[status] = n
            requests: dict[str, dict[str, int]] = {}
            for (worker, status), n in sorted(self._requests.items()):
                requests.setdefault(worker, {})[status] = n
            return {
                "outcomes": outcomes,
                "blocks": dict(self._blocks),
                "events": dict(self._events),
                "requests": requests,
                "hints_sent": dict(self._sent),
            }


class RouterMetrics:
    """The registry ``/metrics`` renders, and the one stateful metric (TTFT)."""

    def __init__(self, router: Router):
        self.registry = CollectorRegistry()
        self._ttft = Histogram(
            f"{PREFIX}_ttft_seconds",
            "Turn arrival to its first byte to the client, by worker",
            ["worker"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Snapshot(router))

    def ttft(self, worker: str, seconds: float) -> None:
        self._ttft.labels(worker).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The text exposition format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Snapshot:
    """A collector over the router's counters and workers, read per scrape."""

    def __init__(self, router: Router):
        self._router = router

    def collect(self):
        r = self._router
        counts = r.counters.to_dict()
        requests = CounterMetricFamily(
            f"{PREFIX}_requests",
            "Turns proxied, by worker and HTTP status (error: no answer)",
            labels=["worker", "status"],
        )
        for worker, statuses in counts["requests"].items():
            for status, n in statuses.items():
                requests.add_metric([worker, status], n)
        outcomes = CounterMetricFamily(
            f"{PREFIX}_hint_outcomes",
            "Hint outcomes by action, via and status",
            labels=["action", "via", "status"],
        )
        for action, vias in counts["outcomes"].items():
            for via, statuses in vias.items():
                for status, n in statuses.items():
                    outcomes.add_metric([action, via, status], n)
        sent = CounterMetricFamily(f"{PREFIX}_hints_sent", "Hints sent, by how", labels=["via"])
        for via, n in sorted(counts["hints_sent"].items()):
            sent.add_metric([via], n)
        events = CounterMetricFamily(
            f"{PREFIX}_events",
            "Router events (moves, new and ended sessions, overlap scoring, retries, ...)",
            labels=["event"],
        )
        for name, n in sorted(counts["events"].items()):
            events.add_metric([name], n)
        blocks = CounterMetricFamily(
            f"{PREFIX}_prompt_blocks",
            "Prompt blocks of finished turns, by where the engine found them",
            labels=["tier"],
        )
        for tier, n in sorted(counts["blocks"].items()):
            blocks.add_metric([tier], n)
        yield from (requests, outcomes, sent, events, blocks)
        healthy = GaugeMetricFamily(
            f"{PREFIX}_worker_healthy", "1 while the worker's /metrics answers", labels=["worker"]
        )
        load = GaugeMetricFamily(
            f"{PREFIX}_worker_load", "The load routing compares", labels=["worker"]
        )
        inflight = GaugeMetricFamily(
            f"{PREFIX}_worker_inflight", "Turns in flight on it", labels=["worker"]
        )
        for name, w in sorted(r.workers.items()):
            healthy.add_metric([name], 1.0 if w.healthy else 0.0)
            load.add_metric([name], float(w.load))
            inflight.add_metric([name], float(w.inflight))
        yield from (healthy, load, inflight)
