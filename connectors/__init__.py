"""vLLM integration: SessionTierConnector, its offloading spec and the CPU worker."""
