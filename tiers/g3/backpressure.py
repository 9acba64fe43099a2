"""A G3 tier's default backpressure: vLLM's G2 -> G3 cascades are dropped
while the tier carries a backlog of them from step to step.

A cascade (vLLM's tiering manager copying chunks just stored in G2 down to
a secondary tier; ``g3.write_through``) is an optional copy: the chunks stay
in G2, and a hint (Demote, Share) can still send them down. While queued, a
cascade holds its G2 slots (vLLM reads them: they cannot be evicted), and on
the tier's I/O threads it is ahead of every G3 load submitted after it. A
tier slower than the engine's stores so grows a queue that takes G2 and
delays promotions, with no bound but G2 itself: vLLM configures no
backpressure unless ``backpressure`` is given, and its EMA detector learns
only from ended cascades (nothing before ten have ended, its warm-up; on
0.32 nothing from failed ones), so a tier that stalls is never pressured.

``CascadeQueue`` is a vLLM ``BackpressureDetector``: vLLM's tiering manager
asks ``should_store(n)`` before each cascade of ``n`` chunks to the tier
(0.32 and 0.33), and a ``G3Tier`` reports each cascade it takes and each
end vLLM collects (``entered``, ``left``; ``chunks`` is what vLLM's tiering
metrics count as cascades in flight), and the end of each step's schedule
(``step_ended``), after vLLM collected what had ended. A cascade is let in
while the backlog the tier carried into the step is below ``max_chunks``:
one step's cascades (a prefill burst) all go while the tier keeps up, and
the queue never holds more than ``max_chunks`` plus one step's cascades.
Dropped cascades are counted by the policy (``DropStorePolicy``), which
vLLM exports with its own gauges of the queue (``connectors/metrics.py``
names them). ``SessionTierSpec`` sizes the default (``default_max_chunks``).

Threading: vLLM calls ``should_store``, and the tier the others, on the
scheduler thread under the tier manager's lock; a lock of its own keeps the
counts right for a reader elsewhere. Cost: O(1) a call.
"""

from __future__ import annotations

import threading

from vllm.v1.kv_offload.tiering.backpressure import (
    BackpressureDetector,
    BackpressurePolicy,
    DropStorePolicy,
)

# The default backlog: an eighth of G2 (hint copies reserve a quarter of it
# at a time and pins half at most, so vLLM's stores still find room), and at
# least one backend call's bytes (``tiers/g3/tier.py`` copies in calls of at most
# its BATCH_BYTES, 64 MiB): less is the tier's call in hand, not a backlog.
G2_SHARE = 8


def default_max_chunks(g2_chunks: int, chunk_bytes: int, call_bytes: int) -> int:
    """The default ``max_chunks`` of a G3 tier over a G2 of ``g2_chunks``
    chunks of ``chunk_bytes``, whose copies go in calls of ``call_bytes``."""
    return max(1, g2_chunks // G2_SHARE, call_bytes // chunk_bytes)


class CascadeQueue(BackpressureDetector):
    """Drops cascades while the tier's carried backlog holds ``max_chunks``
    chunks (see the module docstring). Built by vLLM's tier factory from a
    tier's ``backpressure``: ``{"backpressure_cls":
    "sessionkv.tiers.g3.backpressure.CascadeQueue", "max_chunks": N}``."""

    def __init__(self, max_chunks: int, policy: BackpressurePolicy | None = None):
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ValueError(
                f"backpressure.max_chunks must be a positive integer, got {max_chunks!r}"
            )
        super().__init__(policy=policy or DropStorePolicy())
        self.max_chunks = max_chunks
        self._chunks = 0  # of the cascades taken and not yet collected
        self._carried = 0  # ``_chunks`` when the last step's schedule ended
        self._lock = threading.Lock()

    @property
    def chunks(self) -> int:
        """Chunks of the cascades taken and not yet collected."""
        return self._chunks

    def entered(self, chunks: int) -> None:
        with self._lock:
            self._chunks += chunks

    def left(self, chunks: int) -> None:
        with self._lock:
            self._chunks -= chunks

    def step_ended(self) -> None:
        with self._lock:
            self._carried = self._chunks

    def should_store(self, num_blocks: int) -> bool:
        # vLLM's num_blocks is the cascade's keys: chunks.
        if self._carried < self.max_chunks:
            return True
        self.policy.on_store_skipped(num_blocks)
        return False

    def is_under_pressure(self) -> bool:
        return self._carried >= self.max_chunks

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """Ends are counted by ``left``, failed ones too (0.32 reports
        only successes here)."""

    def reset(self) -> None:
        # vLLM's reset_cache, after it collected every job: the queue is empty.
        with self._lock:
            self._carried = self._chunks
        self.policy.reset()

    @property
    def stats(self) -> dict[str, float]:
        return {"queued_chunks": self._chunks, "max_chunks": self.max_chunks}
