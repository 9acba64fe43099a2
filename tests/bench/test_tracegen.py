"""The trace generator (bench/tracegen.py) and the replay's --suite."""

import json
import sys
from pathlib import Path

import pytest
import tracegen
from replay_trace import BLOCK_TOKENS, parse_rows

PARAMS = sorted((Path(__file__).resolve().parents[2] / "bench" / "traces").glob("*.yaml"))


def small(**kw) -> tracegen.Params:
    base = dict(
        seed=3,
        sessions=30,
        arrival_per_s=1.0,
        turns_mean=4,
        system_tokens=1000,
        first_user_tokens_median=600,
        user_tokens_median=100,
        output_tokens_median=100,
        gaps=(tracegen.Gap(1.0, 10.0, 0.5),),
    )
    return tracegen.Params(**{**base, **kw})


def test_the_suite_has_at_least_six_parameter_files_that_all_load():
    assert len(PARAMS) >= 6
    for p in PARAMS:
        assert tracegen.Params.load(str(p)).sessions > 0


def test_one_parameter_file_gives_one_trace():
    assert tracegen.generate(small()) == tracegen.generate(small())
    assert tracegen.generate(small()) != tracegen.generate(small(seed=4))


def test_rows_are_mooncake_format_with_chained_blocks():
    rows = tracegen.generate(small())
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for r in rows:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // BLOCK_TOKENS)
    # every session starts with the one system prompt: its first block is shared
    assert len({r["hash_ids"][0] for r in rows}) == 1
    tr = parse_rows(rows)
    # sessions rebuilt from the chains alone (the first turn ends in a block
    # of its own: 1000 system tokens and more than 24 of its own)
    assert tr.n_sessions == 30 and sum(tr.continues) == len(rows) - 30


def test_branches_share_only_an_earlier_prefix():
    rows = tracegen.generate(small(branch_p=1.0, sessions=5, turns_mean=6))
    tips = {}
    branched = 0
    for r in rows:
        ids = r["hash_ids"]
        branched += (
            any(tuple(ids[:k]) in tips for k in range(1, len(ids))) and tuple(ids[:-1]) not in tips
        )
        tips[tuple(ids[: r["input_length"] // BLOCK_TOKENS])] = True
    assert branched > 0


@pytest.mark.parametrize(
    "doc, msg",
    [
        ({"sesions": 3}, "unknown key 'sesions'"),
        ({"sessions": "many"}, "sessions must be a number"),
        ({"gaps": []}, "gaps need positive weights"),
    ],
)
def test_bad_parameters_are_named(tmp_path, doc, msg):
    p = tmp_path / "p.yaml"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=msg):
        tracegen.Params.load(str(p))


def test_the_suite_replays_every_trace_and_writes_json_plots_and_a_table(
    tmp_path, monkeypatch, capsys
):
    import replay

    conv = tmp_path / "conv.jsonl"
    conv.write_text("".join(json.dumps(r) + "\n" for r in tracegen.generate(small())))
    monkeypatch.setattr(replay, "SUITE_G2", (16,))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "replay.py",
            "--suite",
            "--trace",
            str(conv),
            "--out-dir",
            str(tmp_path / "out"),
            "--limit",
            "150",
        ],
    )
    replay.main()
    rows = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert [r["trace"] for r in rows] == ["conv"] + [p.stem for p in PARAMS]
    for r in rows:
        assert set(r["x_opt"]) == set(replay.SUITE_POLICIES) and r["session_over_best"] > 0
        assert (tmp_path / "out" / f"{r['trace']}.png").stat().st_size > 1000
        doc = json.loads((tmp_path / "out" / f"{r['trace']}.json").read_text())
        assert {x["policy"] for x in doc["runs"]} == {*replay.SUITE_POLICIES, "opt"}
    assert "session / best simple" in capsys.readouterr().out
