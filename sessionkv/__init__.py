"""sessionkv: session-aware, multi-tier KV-cache management for vLLM.

The public surface, for routers and clients (no vLLM needed): hints and
their outcomes (``KvHint``, ``HintOutcome``, ``sign`` for the router's
signature), the control-channel clients (``HintClient``, ``AsyncHintClient``)
and the per-request report (``RequestReport``); configuration in
``sessionkv.config``, events in ``sessionkv.events``. The vLLM connector is
``sessionkv.connectors.vllm.SessionTierConnector``; ARCHITECTURE.md has the map.
"""

from sessionkv.client import AsyncHintClient, ControlError, HintClient
from sessionkv.hints import HintOutcome, KvHint, sign
from sessionkv.report import RequestReport

__version__ = "0.1.0"
__all__ = [
    "AsyncHintClient",
    "ControlError",
    "HintClient",
    "HintOutcome",
    "KvHint",
    "RequestReport",
    "sign",
]
