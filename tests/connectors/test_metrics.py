"""SessionStats: what sessionkv adds to vLLM's offloading stats (the
/metrics end is in tests/e2e/test_metrics_http.py)."""

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from sessionkv.connectors.metrics import DEFINITIONS, SessionStats
from sessionkv.events import Outcome, Transfer
from sessionkv.hints import HintOutcome, Status
from sessionkv.report import RequestReport


def test_counts_outcomes_moves_and_tokens_then_starts_over():
    s = SessionStats(chunk_bytes=1000, blocks_per_chunk=2)
    s.record(Outcome(outcome=HintOutcome("h", "kv.pin", Status.ACCEPTED), via="request"))
    s.record(Outcome(outcome=HintOutcome("d", "kv.demote", Status.DEFERRED), via="control"))
    s.record(Outcome(outcome=HintOutcome("d", "kv.demote", Status.CLIPPED), via="transfer"))
    s.record(Transfer(src="G1", dst="G2", keys=[b"a", b"b"], ok=True))
    s.record(Transfer(src="G2", dst="G3", keys=[b"a"], ok=True))  # counted by moved()
    s.moved("G2", "G3", 3)
    s.tokens(RequestReport.build("s", 32, 100, 32, 32, 0))
    got = s.take(7, 2, 1).reduce()
    assert got == {
        "sessionkv:hint_outcomes:('kv.pin', 'accepted')": 1,
        "sessionkv:hint_outcomes:('kv.demote', 'clipped')": 1,
        "sessionkv:moved_blocks:('G1', 'G2')": 4,
        "sessionkv:moved_bytes:('G1', 'G2')": 2000,
        "sessionkv:moved_blocks:('G2', 'G3')": 6,
        "sessionkv:moved_bytes:('G2', 'G3')": 3000,
        "sessionkv:prompt_tokens:('g1',)": 32,
        "sessionkv:prompt_tokens:('g2',)": 32,
        "sessionkv:prompt_tokens:('recomputed',)": 36,
        "sessionkv:hit_ratio:('g1',)": 0.32,
        "sessionkv:hit_ratio:('g2',)": 0.32,
        "sessionkv:hit_ratio:('g3',)": 0.0,
        "sessionkv:index_blocks": 7,
        "sessionkv:index_sessions": 2,
        "sessionkv:pinned_chunks": 1,
    }
    again = s.take(7, 2, 1).reduce()
    assert again == {
        "sessionkv:index_blocks": 7,
        "sessionkv:index_sessions": 2,
        "sessionkv:pinned_chunks": 1,
    }


def test_every_name_it_emits_is_declared_for_vllm():
    s = SessionStats(1, 1)
    s.record(Outcome(outcome=HintOutcome("h", "kv.pin", Status.ACCEPTED), via="request"))
    s.moved("G3", "G2", 1)
    s.tokens(RequestReport.build("s", 32, 64, 32, 0, 32))
    stats = s.take(0, 0, 0)
    assert isinstance(stats, OffloadingConnectorStats)
    for name, labels in stats.data["data"].items():
        assert name in DEFINITIONS
        assert all(len(lv) == len(DEFINITIONS[name].labelnames) for lv in labels)


def test_taken_into_vllms_stats_keeps_both():
    s = SessionStats(chunk_bytes=1000, blocks_per_chunk=1)
    s.record(Outcome(outcome=HintOutcome("h", "kv.pin", Status.ACCEPTED), via="request"))
    s.moved("G1", "G2", 2)
    vllms = OffloadingConnectorStats()
    vllms.increase_counter("vllm:some_counter", 5)
    s.moved("G1", "G2", 1)
    got = s.take(7, 2, 1, into=vllms)
    assert got is vllms
    assert got.reduce() == {
        "vllm:some_counter": 5,
        "sessionkv:hint_outcomes:('kv.pin', 'accepted')": 1,
        "sessionkv:moved_blocks:('G1', 'G2')": 3,
        "sessionkv:moved_bytes:('G1', 'G2')": 3000,
        "sessionkv:index_blocks": 7,
        "sessionkv:index_sessions": 2,
        "sessionkv:pinned_chunks": 1,
    }
    assert s.take(7, 2, 1, into=OffloadingConnectorStats()).reduce() == {
        "sessionkv:index_blocks": 7,
        "sessionkv:index_sessions": 2,
        "sessionkv:pinned_chunks": 1,
    }
