"""SessionPrefixIndex: engine-side session topology and residency. Imports no vLLM."""
