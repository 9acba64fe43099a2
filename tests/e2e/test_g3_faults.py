"""Faults injected into Mooncake mid-run (tests/e2e/g3_faults.py): every
request completes with its cold reference's tokens and logprobs, no engine
step waits for the backend, and sharing works again after recovery without
restarting vLLM. The step figures are also written by bench/g3_faults.py."""

from g3_faults import scenario


def test_faults_cost_misses_never_wrong_kv_nor_blocked_steps(tmp_path):
    out = scenario(tmp_path)
    ph = out["phases"]
    assert out["wrong"] == []
    assert ph["normal"]["blocks"]["g3"] >= 24              # sharing through G3 happened
    assert ph["master_restarted"]["blocks"]["g3"] == 6     # recovered without a restart
    assert ph["store_restarted"]["blocks"]["g3"] == 6
    assert ph["store_killed"]["blocks"]["g3"] == 0
    # A blocking lookup would hold a step for 30 s (stopped master) or 4 s
    # (killed master); with deadlines no step waits for Mooncake at all.
    for label in ("master_stopped", "master_killed", "store_killed"):
        assert ph[label]["max_step_s"] < 1.0, (label, ph[label])
    assert ph["master_stopped"]["reset_s"] < 5.0           # drain_jobs is bounded
