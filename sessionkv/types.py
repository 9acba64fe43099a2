"""Small public types shared by every layer."""

from __future__ import annotations

from enum import IntEnum
from typing import Literal


class Tier(IntEnum):
    """Where a copy of a KV block lives (Dynamo KVBM's names)."""

    G1 = 0  # device KV (vLLM's block pool)
    G2 = 1  # pinned host memory (vLLM's CPU primary tier)
    G3 = 2  # shared storage (Mooncake Store, LMCache, Redis)


TIERS = tuple(Tier)
#: A tier as events and reports name it: ``Tier.G2.name``.
TierName = Literal["G1", "G2", "G3"]
