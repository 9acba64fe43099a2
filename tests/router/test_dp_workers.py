"""A data-parallel engine is refused by the router, naming why: each DP rank
has its own cache, index and control channel (``<endpoint_file>.dp<r>``), and
the router keeps one control channel per worker, so hints for sessions served
by other ranks would reach rank 0 only. The endpoint files are fabricated
(DP does not run on the CPU build); the refusal comes before any connection."""

import asyncio
import json

import pytest

from sessionkv.router.config import WorkerConfig
from sessionkv.router.workers import DataParallelWorker, Worker


def test_a_worker_with_a_second_rank_endpoint_file_is_refused(tmp_path):
    base = tmp_path / "engine-a.json"
    for path in (base, tmp_path / "engine-a.json.dp1"):
        path.write_text(
            json.dumps({"control": "tcp://127.0.0.1:9", "events": "tcp://127.0.0.1:10"})
        )
    w = Worker(
        WorkerConfig(name="a", url="http://127.0.0.1:1", endpoint_file=str(base)),
        b"s" * 16,
        http=None,
        load_poll_s=1.0,
    )
    with pytest.raises(
        DataParallelWorker,
        match=r"worker a: .*engine-a\.json\.dp1 exists.*"
        r"--data-parallel-size 1",
    ):
        asyncio.run(w.start())
    assert w.control is None  # refused before connecting
