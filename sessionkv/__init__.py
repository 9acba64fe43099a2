"""sessionkv: session-aware, multi-tier KV-cache management for vLLM.

The public surface: configuration (``sessionkv.config``) and the per-request
report (``sessionkv.report``). The vLLM connector is
``sessionkv.connectors.vllm.SessionTierConnector``.
"""

__version__ = "0.1.0"
