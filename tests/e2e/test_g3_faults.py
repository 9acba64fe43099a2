"""Faults injected into each G3 backend mid-run (tests/e2e/g3_faults.py):
every request completes with its cold reference's tokens and logprobs, no
engine step waits for the backend, resets stay bounded, and sharing works
again after recovery without restarting vLLM. bench/g3_faults.py writes the
step figures."""

import pytest

from sessionkv.devtools.g3_faults import BACKENDS, scenario_process


@pytest.mark.parametrize("backend", BACKENDS)
def test_faults_cost_misses_never_wrong_kv_nor_blocked_steps(backend, tmp_path):
    out = scenario_process(tmp_path, backend)
    ph = out["phases"]
    assert out["wrong"] == []
    assert ph["normal"]["blocks"]["g3"] >= 24, ph  # sharing through G3 happened
    for label, p in ph.items():
        if label.endswith("_restarted"):
            assert p["blocks"]["g3"] == 6, (label, p)  # recovered without a restart
        if label.endswith(("_stopped", "_killed")):
            # A blocking call would hold a step for 30 s (stopped Mooncake
            # master) or seconds (killed one); with deadlines none waits.
            assert p["max_step_s"] < 1.0, (label, p)
        if label.endswith("_stopped"):
            assert p["reset_s"] < 5.0, (label, p)  # drain_jobs is bounded
