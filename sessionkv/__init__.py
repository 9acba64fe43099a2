"""sessionkv: session-aware, multi-tier KV-cache management for vLLM.

The public surface: hint types and the router's signing helper
(``sessionkv.sign``, ``sessionkv.hints``), configuration (``sessionkv.config``)
and the per-request report (``sessionkv.report``). The vLLM connector is
``sessionkv.connectors.vllm.SessionTierConnector``.
"""

from sessionkv.hints import sign

__version__ = "0.1.0"
__all__ = ["sign"]
