"""The router's decisions, kept apart from I/O: where a turn goes, whether a
turn ended in a tool call, how long a Pin holds, and the counters of what
the hints became.

Routing is session affinity first, then KV overlap, then load: a session
stays on its worker until that worker carries ``max_load`` requests (running
+ waiting) and another healthy worker carries fewer and is under
``max_load``; then it moves. A new or moving session goes to the healthy
worker under ``max_load`` (all healthy ones when none is) that holds the most
of its prompt's prefix (``scores``: ``overlap.score``, > 0), else to the
least-loaded one; ties broken by load, then by a counter the replicas share.
A session whose worker is unhealthy moves the same way.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sessionkv.hints import HintOutcome
from sessionkv.report import RequestReport
from sessionkv.router.config import HintPolicy

TOOL_GAP_HEADER = "X-Session-Tool-Gap"


class NoWorker(RuntimeError):
    """No healthy worker to send a turn to."""


class Loaded(Protocol):
    name: str
    healthy: bool
    draining: bool

    @property
    def load(self) -> float: ...


def choose(
    workers: Sequence[Loaded],
    current: str | None,
    max_load: int,
    tie_break: int = 0,
    scores: Mapping[str, float] | None = None,
) -> str:
    """The worker a session's turn goes to (see the module docstring)."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoWorker("no healthy worker")
    # A draining worker takes no turn while another can (its sessions move).
    healthy = [w for w in healthy if not w.draining] or healthy
    least = min(w.load for w in healthy)
    cur = next((w for w in healthy if w.name == current), None)
    if cur is not None:
        if cur.load < max_load or least >= cur.load or least >= max_load:
            return cur.name
    pool = [w for w in healthy if w.load < max_load] or healthy
    scores = scores or {}
    top = max(scores.get(w.name, 0.0) for w in pool)
    if top > 0:
        pool = [w for w in pool if scores.get(w.name, 0.0) == top]
    least = min(w.load for w in pool)
    best = [w for w in pool if w.load == least]
    return best[tie_break % len(best)].name


def tool_gap_from_header(value: str | None, policy: HintPolicy) -> float | None:
    """``X-Session-Tool-Gap: <seconds>`` (or ``default``): the client says this
    turn ends in a tool call expected to last that long. ValueError when malformed."""
    if value is None:
        return None
    if value.strip().lower() in ("", "default"):
        return policy.tool_call.expected_gap_s
    gap = float(value)
    if not 0 < gap < 1e6:
        raise ValueError(f"{TOOL_GAP_HEADER} must be a positive number of seconds")
    return gap


def ends_in_tool_call(response: Mapping[str, Any]) -> bool:
    """Whether an OpenAI response's turn ended in a tool call."""
    for choice in response.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if choice.get("finish_reason") == "tool_calls":
            return True
        message = choice.get("message")
        if isinstance(message, Mapping) and message.get("tool_calls"):
            return True
    return False


def pin_ttl(policy: HintPolicy, gap_s: float) -> float:
    """How long a tool gap's Pin holds (the engine clips it to its own limit)."""
    return gap_s * policy.tool_call.pin_ttl_factor


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


class PinQuota:
    """Router Pins per client (not per session id, which clients choose):
    each client holds Pins for at most ``per_client`` sessions at once, a
    Pin counting until its TTL ends. At most ``max_clients`` clients are
    remembered (least recently pinning first out), each with at most
    ``per_client`` entries, so the map is bounded.

    Threading: the router's event loop only."""

    def __init__(self, per_client: int, max_clients: int, clock):
        self._per = per_client
        self._max = max_clients
        self._clock = clock
        self._pins: OrderedDict[str, dict[str, float]] = OrderedDict()

    def take(self, client: str, session_id: str, ttl_s: float) -> bool:
        """Record a Pin of ``session_id`` for ``ttl_s``; False (nothing
        recorded) when the client already holds its quota of other sessions."""
        now = self._clock()
        held = {s: t for s, t in self._pins.pop(client, {}).items() if t > now}
        if session_id not in held and len(held) >= self._per:
            self._pins[client] = held
            return False
        held[session_id] = now + ttl_s
        self._pins[client] = held
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)
        return True
