"""What the router learns about when sessions come back, and how that turns
into Retain priorities.

``GapModel`` is an online histogram of the waits the router has seen (between
two turns of a session, or between two new sessions through a shared
prefix); ``density`` answers how many reuses per held second a block idle for
``t`` seconds can expect (LHD's hit density, Beckmann et al., NSDI'18), and
``density_priority`` maps that onto the integer priorities
``SessionCachePolicy`` orders by.

Cost: ``add`` is O(log bins); ``refresh`` O(bins^2) and is called once per
router tick; ``density`` is a table lookup. Memory: 72 bins per model.
No I/O, no clock: callers pass times.
"""

from __future__ import annotations

import bisect
import math

import numpy as np


class GapModel:
    """The router's online estimate of how soon an idle continuing session
    returns, learned from the inter-turn gaps it has seen so far.

    A histogram of observed gaps on log-spaced bins (started from a weak
    log-normal prior so that it answers before any gap is seen) gives, for an
    idle time ``t``, the *hit density* of a block held from now on: the best,
    over holding horizons ``h``, of P(the session returns within ``h`` | idle
    ``t``) divided by the expected block-seconds spent holding it until it
    returns or ``h`` runs out. This is the quantity an eviction order should
    rank by when every block of a returning session is reused (LHD, Beckmann
    et al., NSDI'18); it is not monotone in idle time for a log-normal-ish
    gap distribution (a session idle for a minute is likelier to return in
    the next minute than one that has just finished its turn).
    """

    EDGES = np.geomspace(1.0, 20_000.0, 73)  # seconds; 4 bins per doubling

    def __init__(
        self,
        prior_median_s: float = 120.0,
        prior_sigma: float = 1.0,
        prior_weight: float = 10.0,
        prior_never: float = 0.0,
    ):
        mid = np.sqrt(self.EDGES[:-1] * self.EDGES[1:])
        w = np.exp(-0.5 * ((np.log(mid) - np.log(prior_median_s)) / prior_sigma) ** 2)
        self.counts = prior_weight * w / w.sum()
        self.never = prior_never  # mass that never came back
        self.seen = 0
        self._table: list[float] | None = None
        self._dirty = True
        self._edges = self.EDGES.tolist()

    def _bin(self, seconds: float) -> int:
        k = bisect.bisect_right(self._edges, seconds) - 1
        return min(max(k, 0), len(self.counts) - 1)

    def add(self, gap_s: float) -> None:
        """One more observed gap between two turns of a session."""
        self.counts[self._bin(gap_s)] += 1.0
        self.seen += 1
        self._dirty = True

    def add_never(self) -> None:
        """One more wait that ended without a return (given up on)."""
        self.never += 1.0
        self._dirty = True

    def refresh(self) -> None:
        """Recompute the density table from what was added since the last
        refresh (the router calls this once per tick: it is O(bins^2))."""
        if self._dirty or self._table is None:
            self._table = self._densities().tolist()
            self._dirty = False

    def _densities(self) -> np.ndarray:
        c = self.counts
        width = np.diff(self.EDGES)
        # S[j]: mass of gaps longer than EDGES[j]; inside a bin, returns are
        # spread uniformly, so the mass still held decays linearly.
        S = c.sum() + self.never - np.concatenate([[0.0], np.cumsum(c)])
        held = width * (S[:-1] + S[1:]) / 2.0
        out = np.zeros(len(c))
        for j in range(len(c)):
            if S[j] > 1e-9:
                hits = np.cumsum(c[j:])
                out[j] = float((hits / np.maximum(np.cumsum(held[j:]), 1e-12)).max())
        return out  # 0 where nothing is left to come back

    def density(self, idle_s: float) -> float:
        """Expected returns per held-second of a session idle for ``idle_s``."""
        table = self._table
        if table is None:
            self.refresh()
            table = self._table
            assert table is not None  # refresh() computes it
        return float(table[self._bin(idle_s)])

    def median(self) -> float:
        """The median wait of what was seen (with the prior), in seconds."""
        c = np.cumsum(self.counts)
        k = int(np.searchsorted(c, c[-1] / 2.0))
        return float(math.sqrt(self.EDGES[k] * self.EDGES[k + 1]))


def density_priority(density: float) -> int:
    """A Retain priority from a hit density (reuses per second held): four
    steps per doubling (1e-6/s -> 1, 1/s -> 80), so the policy's integer
    order follows the density order and hints change only on a real change;
    0 means "plain" to the policy, hence at least 1."""
    return int(max(1, round(4 * math.log2(max(density, 1e-9) * 1e6))))
