"""The replay's time model (bench/replay_time.py) on hand-made event streams
with answers worked out by hand, and the oracle on small generated traces."""

import pytest
import replay
import tracegen
from replay_sim import RunSpec
from replay_time import (
    HINTS,
    PARAMS,
    PREFETCH,
    TURN,
    Link,
    TimeParams,
    gain_captured,
    oracle_events,
    turn_times,
)
from replay_trace import parse_rows

# Round figures: 1 byte a token, prefill 100 tokens/s (10 ms a token), G2 at
# 1,000 tokens/s (1 ms) with 10 ms latency, G3 at 200 tokens/s (5 ms) with
# 20 ms latency, 2 ms a hint.
P = TimeParams(
    name="test",
    kv_bytes_per_token=1,
    prefill_tokens_per_s=100.0,
    g2=Link(bandwidth=1000.0, latency=0.010),
    g3=Link(bandwidth=200.0, latency=0.020),
    hint_s=0.002,
)


def turn(t, i, g1=0, g2=0, g3=0, miss=0, w=0):
    return (TURN, t, w, i, g1, g2, g3, miss)


def test_a_turn_pays_its_loads_then_its_prefill_and_g1_is_free():
    (r,) = turn_times([turn(0.0, 0, g1=500, g2=100, miss=10)], P).values()
    assert r.load == pytest.approx(0.010 + 0.100)
    assert r.prefill == pytest.approx(0.100)
    assert r.ttft == pytest.approx(0.210) and r.recomputed == 0


def test_competing_transfers_queue_on_one_link_per_engine():
    # Two turns at t=0 on one engine, 100 G2 tokens each: the second waits
    # for the first (0.11 s) and then takes its own 0.11 s.
    times = turn_times([turn(0.0, 0, g2=100), turn(0.0, 1, g2=100)], P)
    assert times[0].ttft == pytest.approx(0.110)
    assert times[1].ttft == pytest.approx(0.220)
    # On two engines they do not compete.
    times = turn_times([turn(0.0, 0, g2=100), turn(0.0, 1, g2=100, w=1)], P)
    assert times[1].ttft == pytest.approx(0.110)
    # Unless transfers are planned (the oracle's): no wait.
    times = turn_times([turn(0.0, 0, g2=100), turn(0.0, 1, g2=100)], P, queue=False)
    assert times[1].ttft == pytest.approx(0.110)
    # A turn after the first transfer has finished does not wait.
    times = turn_times([turn(0.0, 0, g2=100), turn(1.0, 1, g2=100)], P)
    assert times[1].ttft == pytest.approx(0.110)


def test_a_g3_hit_crosses_the_g3_link_and_then_g2():
    (r,) = turn_times([turn(0.0, 0, g3=10)], P).values()
    # G3: 20 ms + 10 x 5 ms = 70 ms; then over G2 10 x 1 ms: 80 ms (recompute: 100 ms)
    assert r.ttft == pytest.approx(0.080) and r.recomputed == 0


def test_a_tier_slower_than_recompute_is_recomputed():
    # 100 G3 tokens: 20 ms + 500 ms + 100 ms over G2 against 1 s of prefill: loaded.
    # With G3 at 50 tokens/s (20 ms a token) recompute wins: prefill only.
    slow = TimeParams(**{**P.__dict__, "g3": Link(bandwidth=50.0, latency=0.020)})
    (r,) = turn_times([turn(0.0, 0, g3=100)], slow).values()
    assert r.recomputed == 100 and r.load == 0.0
    assert r.ttft == pytest.approx(1.0)
    # ...and so is a G2 load that would queue longer than recomputing it.
    times = turn_times([turn(0.0, 0, g2=5000), turn(0.0, 1, g2=10, miss=0)], P)
    assert times[1].recomputed == 10 and times[1].ttft == pytest.approx(0.1)
    # The H100 figures: a TCP G3 (1.26 GB/s at 128 KiB a token) loses to prefill.
    h = PARAMS["h100-8b"]
    (r,) = turn_times([turn(0.0, 0, g3=4096)], h).values()
    assert r.recomputed == 4096 and r.ttft == pytest.approx(4096 / h.prefill_tokens_per_s)
    (r,) = turn_times([turn(0.0, 0, g2=4096)], h).values()
    assert r.recomputed == 0 and r.ttft < 0.1 * 4096 / h.prefill_tokens_per_s


def test_a_late_prefetch_is_a_miss_for_the_blocks_not_yet_copied():
    # A Prefetch of 4 blocks of 10 tokens at t=0 over G3: block k done at
    # 20 ms + 50 ms x k. The turn at 0.125 s finds 2 blocks copied (70, 120 ms)
    # and misses 2 (170, 220 ms).
    ev = [(PREFETCH, 0.0, 0, 7, [10, 10, 10, 10]), turn(0.125, 7, g2=40)]
    (r,) = turn_times(ev, P).values()
    assert r.late == 20
    assert r.prefill == pytest.approx(20 / 100)
    assert r.load == pytest.approx(0.010 + 0.020)
    # In time, it is a G2 hit.
    ev = [(PREFETCH, 0.0, 0, 7, [10, 10, 10, 10]), turn(1.0, 7, g2=40)]
    (r,) = turn_times(ev, P).values()
    assert r.late == 0 and r.ttft == pytest.approx(0.050)
    # A Prefetch holds the G3 link: a turn's G3 load (100 tokens: 0.62 s
    # alone) queues behind it until 0.22 s.
    ev = [(PREFETCH, 0.0, 0, 7, [10] * 4), turn(0.0, 1, g3=100)]
    (r,) = turn_times(ev, P).values()
    assert r.recomputed == 0 and r.ttft == pytest.approx(0.220 + 0.020 + 0.500 + 0.100)


def test_hint_work_holds_the_engine_before_the_turn():
    ev = [(HINTS, 0.0, 0, 10), turn(0.0, 0, miss=1), (HINTS, 5.0, 1, 10), turn(5.0, 1)]
    times = turn_times(ev, P)
    assert times[0].hint_wait == pytest.approx(0.020)
    assert times[0].ttft == pytest.approx(0.030)
    # Work done long before a turn costs it nothing.
    times = turn_times([(HINTS, 0.0, 0, 10), turn(1.0, 0, miss=1)], P)
    assert times[0].hint_wait == 0.0


def test_gain_captured():
    assert gain_captured(10.0, 10.0, 4.0) == 0.0
    assert gain_captured(10.0, 4.0, 4.0) == 1.0
    assert gain_captured(10.0, 7.0, 4.0) == pytest.approx(0.5)
    assert gain_captured(4.0, 4.0, 4.0) is None


def test_the_oracle_keeps_what_g1_holds_and_loads_the_rest_from_g2():
    tr = parse_rows(
        [
            {"timestamp": t * 1000, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}
            for t in range(3)
        ]
    )
    # opt hit 1,024, 512 and 0 tokens; G1 held 512, 512 and 1,024
    ev = oracle_events(tr, [1024, 512, 0], [512, 512, 1024])
    assert [e[4:] for e in ev] == [(512, 512, 0, 0), (512, 0, 0, 512), (1024, 0, 0, 0)]


def small_trace(seed):
    p = tracegen.Params(
        seed=seed,
        sessions=40,
        arrival_per_s=0.5,
        turns_mean=5,
        system_tokens=1000,
        first_user_tokens_median=1500,
        user_tokens_median=300,
        output_tokens_median=200,
        gaps=(tracegen.Gap(1.0, 20.0, 0.8),),
    )
    return parse_rows(tracegen.generate(p), f"small{seed}")


@pytest.mark.parametrize("seed", [1, 2])
def test_the_oracle_bounds_every_policy_and_lru_captures_nothing(seed):
    tr = small_trace(seed)
    specs = [
        RunSpec(p, 24, None, 1, "sticky", 0, 0)
        for p in ("lru", "arc", "naive", "naive-unbounded", "session")
    ]
    specs.append(RunSpec("opt", specs[0].total_capacity, 0, 1, "sticky", 0, 0))
    out = replay.replay(tr, specs)
    runs = {r["policy"]: r for r in out["runs"]}
    for name in PARAMS:
        oracle = runs["opt"]["time"][name]
        assert oracle["turns"] > 50
        for p, r in runs.items():
            t = r["time"][name]
            assert t["turns"] == oracle["turns"]
            assert oracle["ttft_mean_s"] <= t["ttft_mean_s"] + 1e-9, (p, name)
            if p != "opt":
                assert t["oracle_gain_captured"] is not None
                assert t["oracle_gain_captured"] <= 1.0 + 1e-9
        assert runs["lru"]["time"][name]["oracle_gain_captured"] == 0.0
        assert runs["lru"]["time"][name]["hint_wait_mean_s"] == 0.0
        assert runs["session"]["time"][name]["hint_wait_mean_s"] > 0.0
    assert "oracle gain captured" in replay.time_table(out["runs"])
