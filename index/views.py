"""What the SessionPrefixIndex answers with: resolved blocks, session
summaries, and the 64-bit alias of a key. Plain values, no index state."""

from __future__ import annotations

from dataclasses import dataclass

from sessionkv.types import Tier


def alias64(key: bytes) -> int:
    """The 64-bit alias event consumers see for a key: the low 64 bits of its
    block hash, as vLLM's KV events report it (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return int.from_bytes(key[-12:-4], "big")


@dataclass(frozen=True)
class Resolved:
    """Resident blocks a selector names, per tier, each list root-to-leaf
    (shallower first; ties by key). ``keys`` holds every resident block once."""

    keys: list[bytes]
    per_tier: dict[Tier, list[bytes]]


@dataclass(frozen=True)
class SessionSummary:
    """A session at a glance, for status views."""

    session_id: str
    frontiers: list[bytes]
    blocks: int                      # resident member blocks
    per_tier: dict[Tier, int]        # member blocks with a copy in each tier
    last_access: float
