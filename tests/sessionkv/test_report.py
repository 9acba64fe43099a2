from sessionkv.report import RequestReport, TierCounts


def test_report_counts_and_round_trip():
    rep = RequestReport.build("s1", 32, prompt_tokens=200, g1_tokens=64, g2_tokens=96, g3_tokens=0)
    assert rep.tokens == TierCounts(64, 96, 0, 40)
    assert rep.blocks == TierCounts(2, 3, 0, 2)  # 40 recomputed tokens span 2 blocks
    params = {"other": 1, **rep.to_params()}
    assert RequestReport.from_params(params) == rep
    assert RequestReport.from_params({"other": 1}) is None


def test_report_caps_hits_at_the_prompt():
    # After a preemption, hits cover generated tokens too; the report covers the prompt.
    rep = RequestReport.build(None, 32, prompt_tokens=100, g1_tokens=64, g2_tokens=64, g3_tokens=32)
    assert rep.tokens == TierCounts(64, 36, 0, 0)
    assert rep.blocks == TierCounts(2, 1, 0, 0)


def test_totals_only_withholds_what_any_cache_held():
    rep = RequestReport.build("s1", 32, prompt_tokens=200, g1_tokens=64, g2_tokens=96, g3_tokens=0)
    assert rep.cached_tokens == 160
    bare = rep.totals_only()
    assert (bare.tokens, bare.blocks, bare.cached_tokens, bare.prompt_tokens) == (
        None,
        None,
        None,
        200,
    )
    assert RequestReport.from_params(bare.to_params()) == bare


def test_a_newer_engines_fields_are_tolerated():
    doc = RequestReport.build(None, 32, 64, 32, 0, 0).to_params()
    doc["sessionkv"]["from_the_future"] = 1
    doc["sessionkv"]["tokens"]["g4"] = 0
    assert RequestReport.from_params(doc).cached_tokens == 32
