import pytest

from sessionkv.report import RequestReport, TierCounts


def test_report_counts_and_round_trip():
    rep = RequestReport.build("s1", 32, prompt_tokens=200, g1_tokens=64, g2_tokens=96, g3_tokens=0)
    assert rep.tokens == TierCounts(64, 96, 0, 40)
    assert rep.blocks == TierCounts(2, 3, 0, 2)   # 40 recomputed tokens span 2 blocks
    params = {"other": 1, **rep.to_params()}
    assert RequestReport.from_params(params) == rep
    assert RequestReport.from_params({"other": 1}) is None


def test_report_rejects_more_hits_than_prompt():
    with pytest.raises(ValueError):
        RequestReport.build(None, 32, prompt_tokens=10, g1_tokens=32, g2_tokens=0, g3_tokens=0)
