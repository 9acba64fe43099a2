"""The per-request report an engine returns in the response's ``kv_transfer_params``.

A finished request's response carries ``kv_transfer_params["sessionkv"]``: where
its prompt KV came from. Counts are in tokens and in blocks of the engine's
G1 block size; hits are whole blocks, the recomputed tail may end mid-block.
Only non-streaming responses carry ``kv_transfer_params`` (a vLLM limitation).

``cached_tokens`` (prompt tokens not recomputed, the total vLLM itself reports
as ``usage.prompt_tokens_details.cached_tokens``), the per-tier ``tokens`` and
``blocks`` are null unless the policy's ``report.per_tier`` gives them to this
request (``signed``, the default: only requests the router signed, see
``sessionkv.config.ReportPolicy``): with a shared G3 the total, too, tells a
client that another engine's client sent its prompt.

Readers tolerate fields they do not know (a newer engine's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from sessionkv.hints import HintOutcome

REPORT_KEY = "sessionkv"


class TierCounts(msgspec.Struct, frozen=True):
    """Prompt tokens (or blocks) by where their KV came from."""

    g1: int = 0
    g2: int = 0
    g3: int = 0
    recomputed: int = 0


class RequestReport(msgspec.Struct, frozen=True):
    """Where one request's prompt KV came from."""

    session_id: str | None
    block_size: int
    prompt_tokens: int
    tokens: TierCounts | None  # None: withheld (``report.per_tier``)
    blocks: TierCounts | None
    hints: tuple[HintOutcome, ...] = ()  # one outcome per hint the request carried
    cached_tokens: int | None = 0  # prompt tokens whose KV was not recomputed; None: withheld

    @classmethod
    def build(
        cls,
        session_id: str | None,
        block_size: int,
        prompt_tokens: int,
        g1_tokens: int,
        g2_tokens: int,
        g3_tokens: int,
        hints: tuple[HintOutcome, ...] = (),
    ) -> RequestReport:
        # Hits are counted against the whole sequence of the request's last
        # scheduling attempt, which after a preemption includes generated
        # tokens; the report covers the prompt, so each tier is capped by what
        # is left of it, nearest tier first. Never raises: it runs in the engine.
        left = prompt_tokens
        g1_tokens = min(g1_tokens, left)
        left -= g1_tokens
        g2_tokens = min(g2_tokens, left)
        left -= g2_tokens
        g3_tokens = min(g3_tokens, left)
        recomputed = left - g3_tokens
        tokens = TierCounts(g1_tokens, g2_tokens, g3_tokens, recomputed)
        blocks = TierCounts(
            g1_tokens // block_size,
            g2_tokens // block_size,
            g3_tokens // block_size,
            -(-recomputed // block_size),
        )
        return cls(
            session_id,
            block_size,
            prompt_tokens,
            tokens,
            blocks,
            tuple(hints),
            prompt_tokens - recomputed,
        )

    def totals_only(self) -> RequestReport:
        """This report without the counts of what a cache held (per tier and
        in all): the prompt's length and the hints' outcomes."""
        return msgspec.structs.replace(self, tokens=None, blocks=None, cached_tokens=None)

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` entry, JSON-ready."""
        return {REPORT_KEY: msgspec.to_builtins(self)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RequestReport | None:
        """Read the report back from a response's ``kv_transfer_params``."""
        if not params or REPORT_KEY not in params:
            return None
        return msgspec.convert(params[REPORT_KEY], cls)
