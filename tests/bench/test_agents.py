"""bench/agents.py: its workload and figures on hand-made numbers, and its
``--quick`` run end to end (real vLLM servers, the router, Mooncake), so the
bench cannot rot. The acceptance figures come from its full run (bench/README.md)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agents_workload import (
    Shape,
    TurnResult,
    coding_shape,
    make_tasks,
    max_context,
    run_figures,
    summary,
)

ROOT = Path(__file__).resolve().parents[2]


def test_tasks_are_drawn_once_from_the_seed():
    shape = Shape(tasks=9, seed=3)
    a, b = make_tasks(shape), make_tasks(shape)
    assert a == b and a != make_tasks(Shape(tasks=9, seed=4))
    docs = {t.doc for t in a}
    assert docs == {0, 1, None}
    for t in a:
        assert shape.turns[0] <= t.turns <= shape.turns[1]
        assert all(0.2 <= s <= shape.tool_max_s for s in t.tools)
        assert len(t.head) == shape.task_tokens + (shape.doc_tokens if t.doc is not None else 0)
    # Tasks over one document share its tokens exactly (a shared prefix).
    same = [t for t in a if t.doc == 0]
    assert len(same) >= 2 and same[0].head[: shape.doc_tokens] == same[1].head[: shape.doc_tokens]
    assert max_context(shape) >= max(len(t.head) + sum(map(len, t.results)) for t in a)


def test_the_default_workload_is_what_it_was():
    # The coding workload's draws come after the default's: the default tasks
    # (and the figures measured on them) stay the same.
    tasks = make_tasks(Shape())
    drawn = repr([(t.head, t.tools, t.results) for t in tasks]).encode()
    assert hashlib.blake2b(drawn, digest_size=8).hexdigest() == "c3b826a1edbfbb55"
    assert all(t.sub is None and not t.compact_after for t in tasks)
    assert max_context(Shape(), tasks) <= max_context(Shape())


def test_coding_tasks_branch_sub_agents_and_compact():
    shape = coding_shape()
    tasks = make_tasks(shape)
    assert tasks == make_tasks(coding_shape()) and tasks != make_tasks(coding_shape(seed=1))
    assert all(t.doc is not None and t.doc_tokens == shape.doc_tokens for t in tasks)
    assert all(shape.turns[0] <= t.turns <= shape.turns[1] for t in tasks)
    subs = [t for t in tasks if t.sub is not None]
    assert subs and all(0 < t.sub_at < t.turns - 1 for t in subs)
    compacted = [t for t in tasks if t.compact_after]
    assert compacted
    for t in compacted:
        lengths = t.prompt_lengths(shape.output_tokens)
        k = t.compact_after[0]
        # The turn after a compaction restarts from the document, a summary
        # and the tool result; until then the context only grows.
        assert lengths[k + 1] == shape.doc_tokens + shape.summary_tokens + len(t.results[k])
        assert lengths[: k + 1] == sorted(lengths[: k + 1]) and lengths[k] > lengths[k + 1]
        assert max(lengths) <= shape.compact_tokens + shape.output_tokens + shape.tool_tokens[1]
    gaps = sorted(g for t in tasks for g in t.tools)
    assert gaps[len(gaps) // 2] < 2.0 < gaps[-1]  # a short median, a long tail
    assert max_context(shape, tasks) + shape.output_tokens >= max(
        n for t in tasks for n in t.prompt_lengths(shape.output_tokens)
    )


def turn(task, k, ttft, prompt, cached, worker, moved=False, prefix=0):
    return TurnResult(task, k, ttft, prompt, cached, worker, moved, prefix)


def test_figures_count_resumed_and_moved_turns():
    turns = [
        turn(0, 0, 3.0, 1000, 0, "a"),
        turn(0, 1, 0.5, 1200, 960, "a", prefix=1000),
        turn(0, 2, 2.0, 1400, 800, "b", moved=True, prefix=1200),  # 400 of 1200 missing
        turn(1, 0, 1.0, 500, 0, "b"),
        turn(1, 1, 1.5, 700, 480, "a", moved=True, prefix=500),
    ]  # 20 of 500 missing
    f = run_figures(turns, [10.0, 4.0])
    assert f["resumed_turns"] == 3 and f["resumed_ttft_p50_s"] == 1.5
    assert f["recomputed_tokens"] == 4800 - 2240
    assert f["moved_turns"] == 2
    assert f["moved_prefix_recomputed_fraction"] == pytest.approx(420 / 1700)
    assert f["task_s_p50"] == 7.0


def test_summary_ratios_are_medians_of_ratios_within_a_round():
    runs = {
        "lru": [
            {"resumed_ttft_p50_s": 2.0, "recomputed_tokens": 100},
            {"resumed_ttft_p50_s": 4.0, "recomputed_tokens": 100},
            {"resumed_ttft_p50_s": 1.0, "recomputed_tokens": 100},
        ],
        "sessionkv": [
            {"resumed_ttft_p50_s": 1.0, "recomputed_tokens": 50},
            {"resumed_ttft_p50_s": 1.0, "recomputed_tokens": 30},
            {"resumed_ttft_p50_s": 1.0, "recomputed_tokens": 10},
        ],
    }
    s = summary(runs)
    assert s["resumed_ttft_p50_ratio_to_lru"] == 0.5  # of 0.5, 0.25, 1.0
    assert s["recomputed_ratio_to_lru"] == 0.3
    assert s["resumed_ttft_p50_ratio_to_oracle"] is None  # no oracle runs
    assert s["modes"]["lru"]["resumed_ttft_p50_s"] == 2.0
    assert s["modes"]["lru"]["resumed_ttft_p50_s_spread"] == [1.0, 4.0]


def test_a_quick_run_serves_every_mode_exactly(tmp_path):
    out, png = tmp_path / "agents.json", tmp_path / "agents.png"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run(
        [sys.executable, "bench/agents.py", "--quick", "--json", str(out), "--plot", str(png)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=900,
    )
    doc = json.loads(out.read_text())
    assert doc["outputs_equal"] is True and doc["outputs_differing"] == []
    runs = {}
    for mode in ("plain", "lru", "lru+g3", "sessionkv", "oracle"):
        (runs[mode],) = doc["runs"][mode]
        assert runs[mode]["errors"] == 0 and runs[mode]["resumed_turns"] > 0
        assert runs[mode]["turns"] == doc["sizes"]["turns"] == len(runs[mode]["turn_records"])
    assert runs["plain"]["prompt_tokens_by_source"] == {}  # no connector
    served = 0
    for mode in ("lru", "lru+g3", "sessionkv", "oracle"):
        by = runs[mode]["prompt_tokens_by_source"]
        assert sum(by.values()) == runs[mode]["prompt_tokens"]
        served += by.get("g2", 0) + by.get("g3", 0)
    # G1 cannot keep two agents' contexts: below it the connector served some
    # prefix (which mode's, the closed loop's timing decides).
    assert served > 0
    assert runs["lru"]["prompt_tokens_by_source"].get("g3", 0) == 0  # no G3
    for key in (
        "resumed_ttft_p50_ratio_to_lru",
        "resumed_ttft_p50_ratio_to_oracle",
        "recomputed_ratio_to_lru",
        "resumed_ttft_p50_ratio_to_lru+g3",
        "task_s_p50_ratio_to_lru+g3",
    ):
        assert doc["summary"][key] > 0
    # The attribution: the router's part of each resumed turn and the
    # engines' queue and prefill, per mode.
    for mode, run in runs.items():
        assert 0 <= run["resumed_routed_s_mean"] < run["resumed_ttft_p50_s"] * 10
        assert run["engine_s_per_request"]["ttft"] > 0, mode
        assert run["engine_s_per_request"]["prefill"] > 0, mode
    assert runs["lru+g3"]["hints_sent"].get("policy", 0) == 0
    assert runs["sessionkv"]["engine_s_total"].get("hints", 0) > 0  # its Retains' work
    assert runs["lru+g3"]["engine_s_total"].get("hints", 0) == 0
    assert runs["lru+g3"]["moved_bytes"].get("G2>G3", 0) > 0  # written through
    assert "moved_prefix_recomputed_fraction" in doc["summary"]
    assert png.stat().st_size > 10_000
