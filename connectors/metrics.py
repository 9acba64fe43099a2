"""sessionkv's metrics on the engine's ``/metrics``, through vLLM's own
offloading metrics: ``SessionTierSpec.build_metric_definitions`` declares
them (vLLM creates the Prometheus metrics in the API server process), and
the tier manager's ``get_stats`` hands vLLM the observations since the last
call (``SessionStats.take``), which travel with the scheduler's stats.

| metric | kind | labels |
| --- | --- | --- |
| ``sessionkv:hint_outcomes`` | counter | ``action``, ``outcome`` (finals of deferred hints included) |
| ``sessionkv:moved_blocks`` / ``sessionkv:moved_bytes`` | counter | ``src``, ``dst`` (G1, G2, G3) |
| ``sessionkv:prompt_tokens`` | counter | ``source`` (g1, g2, g3, recomputed) |
| ``sessionkv:hit_ratio`` | gauge | ``tier``: prompt tokens served from it / all, since start |
| ``sessionkv:index_blocks``, ``sessionkv:index_sessions`` | gauge | |
| ``sessionkv:pinned_chunks`` | gauge | |
| ``sessionkv:g3_rejected_objects`` | counter | ``tier``: objects there but unreadable or failing their checksum or MAC (unlisted, recomputed) |
| ``sessionkv:lock_wait_seconds`` | counter | the scheduler's waits for the lock at a step's start |
| ``sessionkv:control_seconds`` | counter | ``op``: the control thread's time per op (``hints``, ``end_session``, ``moves``, ...) |

G3 write-through's queue and its backpressure (``tiers/g3/backpressure.py``)
are on vLLM's own tiering metrics (0.32 and 0.33), which pass through here
(``take(into=...)``), labelled ``tier`` ``<n>:<type>`` (``1:RedisTier``):
``vllm:kv_offload_tiering_active_cascade_jobs`` (cascades queued or
running), ``vllm:kv_offload_tiering_primary_read_usage_perc`` (their chunks,
as a share of G2: what the default bounds), and
``vllm:kv_offload_tiering_backpressure_stores_dropped`` /
``..._blocks_dropped`` (cascades and chunks dropped; counters). sessionkv adds
none of its own for them (``tests/connectors/test_g3_backpressure.py``).

Prometheus adds ``_total`` to counter names. Threading: ``record`` and
``tokens`` from any thread (a lock of its own), ``take`` from the scheduler.
"""

from __future__ import annotations

import threading

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from sessionkv.events import Outcome, Transfer
from sessionkv.report import RequestReport

OUTCOMES = "sessionkv:hint_outcomes"
MOVED_BLOCKS = "sessionkv:moved_blocks"
MOVED_BYTES = "sessionkv:moved_bytes"
PROMPT_TOKENS = "sessionkv:prompt_tokens"
HIT_RATIO = "sessionkv:hit_ratio"
INDEX_BLOCKS = "sessionkv:index_blocks"
INDEX_SESSIONS = "sessionkv:index_sessions"
PINNED = "sessionkv:pinned_chunks"
G3_REJECTED = "sessionkv:g3_rejected_objects"
LOCK_WAIT = "sessionkv:lock_wait_seconds"
CONTROL = "sessionkv:control_seconds"
SOURCES = ("g1", "g2", "g3", "recomputed")

DEFINITIONS: dict[str, OffloadingMetricMetadata] = {
    OUTCOMES: OffloadingCounterMetadata(
        "Hint outcomes by action and outcome.", ("action", "outcome")
    ),
    MOVED_BLOCKS: OffloadingCounterMetadata("KV blocks copied between tiers.", ("src", "dst")),
    MOVED_BYTES: OffloadingCounterMetadata("KV bytes copied between tiers.", ("src", "dst")),
    PROMPT_TOKENS: OffloadingCounterMetadata(
        "Prompt tokens by where their KV came from.", ("source",)
    ),
    HIT_RATIO: OffloadingGaugeMetadata(
        "Share of prompt tokens served from each tier since the engine started.", ("tier",)
    ),
    INDEX_BLOCKS: OffloadingGaugeMetadata("Blocks in the SessionPrefixIndex."),
    INDEX_SESSIONS: OffloadingGaugeMetadata("Live sessions in the SessionPrefixIndex."),
    PINNED: OffloadingGaugeMetadata("G2 chunks pinned by hints."),
    G3_REJECTED: OffloadingCounterMetadata(
        "G3 objects found but unreadable or failing their "
        "checksum or MAC: unlisted and recomputed.",
        ("tier",),
    ),
    LOCK_WAIT: OffloadingCounterMetadata(
        "Seconds the scheduler waited at a step's start for "
        "another thread's hold of the tier manager's lock."
    ),
    CONTROL: OffloadingCounterMetadata(
        "Seconds the control thread spent per op (hints, "
        "end_session, moves: finishing hint copies; ...), its "
        "wait for the lock included.",
        ("op",),
    ),
}


class SessionStats:
    """Observations for vLLM's stats (see the module docstring)."""

    def __init__(self, chunk_bytes: int, blocks_per_chunk: int):
        self._chunk_bytes = chunk_bytes
        self._bpc = blocks_per_chunk
        self._lock = threading.Lock()
        self._stats = OffloadingConnectorStats()
        self._tokens = dict.fromkeys(SOURCES, 0)  # since start, for the ratio
        self._outcomes: dict[str, int] = {}  # "action/outcome" -> since start
        self._rejected: dict[str, int] = {}  # G3 tier -> rejected objects counted
        self._chunks_moved: dict[tuple[str, str], int] = {}  # (src, dst) -> since ``take``

    def record(self, event: object) -> None:
        """Count an event the manager emits (outcomes, G1<->G2 transfers)."""
        with self._lock:
            if isinstance(event, Outcome) and event.outcome.status != "deferred":
                o = event.outcome
                status = getattr(o.status, "value", o.status)
                self._stats.increase_counter(OUTCOMES, 1, (o.action or "none", status))
                name = f"{o.action or 'none'}/{status}"
                self._outcomes[name] = self._outcomes.get(name, 0) + 1
            elif isinstance(event, Transfer) and event.ok and "G3" not in (event.src, event.dst):
                self._moved(event.src, event.dst, len(event.keys))

    def moved(self, src: str, dst: str, chunks: int) -> None:
        """Count chunks copied (G2<->G3: the G3 tier's copies)."""
        with self._lock:
            self._moved(src, dst, chunks)

    def _moved(self, src: str, dst: str, chunks: int) -> None:
        # Summed per (src, dst) and put into the stats by ``take``: a decode
        # step stores a block of every 16th request, each counted here.
        if chunks:
            self._chunks_moved[src, dst] = self._chunks_moved.get((src, dst), 0) + chunks

    def lock_waited(self, seconds: float) -> None:
        """The scheduler waited ``seconds`` for the lock (another thread held it)."""
        with self._lock:
            self._stats.increase_counter(LOCK_WAIT, seconds)

    def control_work(self, op: str, seconds: float) -> None:
        """The control thread spent ``seconds`` on ``op`` (a bounded set of names)."""
        with self._lock:
            self._stats.increase_counter(CONTROL, seconds, (op,))

    def tokens(self, report: RequestReport) -> None:
        """Count a finished request's prompt tokens by source."""
        with self._lock:
            for source in SOURCES:
                n = getattr(report.tokens, source)
                self._tokens[source] += n
                if n:
                    self._stats.increase_counter(PROMPT_TOKENS, n, (source,))
            total = sum(self._tokens.values())
            for source in SOURCES[:3]:
                self._stats.set_gauge(
                    HIT_RATIO, self._tokens[source] / total if total else 0.0, (source,)
                )

    def outcome_totals(self) -> dict[str, int]:
        """Final hint outcomes since start, by ``action/outcome``."""
        with self._lock:
            return dict(sorted(self._outcomes.items()))

    def take(
        self,
        blocks: int,
        sessions: int,
        pinned: int,
        rejected: dict[str, int] | None = None,
        into: OffloadingConnectorStats | None = None,
        copied: dict[tuple[str, str], int] | None = None,
    ) -> OffloadingConnectorStats:
        """The observations since the last call, with the gauges as read now
        by the caller: index blocks, live sessions, pinned chunks; each G3
        tier's rejected objects since start (counted here by difference); and
        the chunks the caller counted copied since its last call
        (``copied``: (src, dst) -> chunks, the scheduler's G1 <-> G2 copies).
        Written into ``into`` (vLLM's stats of the step) when given, rather
        than into a second object that vLLM's ``aggregate`` merges: every
        step calls this."""
        with self._lock:
            if into is not None and not into.is_empty():
                stats = into  # a new object only after something was recorded
                if not self._stats.is_empty():
                    stats, self._stats = into.aggregate(self._stats), OffloadingConnectorStats()
            else:
                stats, self._stats = self._stats, OffloadingConnectorStats()
            moved, self._chunks_moved = self._chunks_moved, {}
            for pair, chunks in (copied or {}).items():
                moved[pair] = moved.get(pair, 0) + chunks
            for tier, total in (rejected or {}).items():
                new = total - self._rejected.get(tier, 0)
                if new > 0:
                    stats.increase_counter(G3_REJECTED, new, (tier,))
                self._rejected[tier] = total
        for pair, chunks in moved.items():
            stats.increase_counter(MOVED_BLOCKS, chunks * self._bpc, pair)
            stats.increase_counter(MOVED_BYTES, chunks * self._chunk_bytes, pair)
        stats.set_gauge(INDEX_BLOCKS, blocks)
        stats.set_gauge(INDEX_SESSIONS, sessions)
        stats.set_gauge(PINNED, pinned)
        return stats
