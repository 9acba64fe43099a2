"""Demote, Prefetch and Share on real vLLM (tiny model, 12-chunk G2, G3 on
Redis, then on the local-disk tier, with ``write_through: false``), each compared with the same run
without the hint. Engine A runs in this process and gets its hints over the
control channel while idle (no step runs between ``serve`` calls); engine B,
which receives a Share, is its own process (``devtools/g3_engine.py``). G1 is
poisoned before every measured turn, and G2 before a copy into it, so a hint
that answers without moving bytes fails; outputs equal cold references in
tokens and logprobs.
"""

import time
import uuid

import pytest
from test_pin_retain import CHUNK_BYTES, G2_CHUNKS, SECRET, P, cold, in_g2, reset_g1, run

from sessionkv.client import HintClient
from sessionkv.devtools.engines import (
    TINY,
    control_hint,
    engine_process,
    kv_transfer_config,
    new_engine_id,
    poison_g2,
    tiny_llm,
)
from sessionkv.devtools.keys import keys_of
from sessionkv.devtools.server import remove_offload_region
from sessionkv.index.prefix_index import alias64

POLICY = (
    "g2: {eviction: session}\ng3: {write_through: false}\n"
    "limits: {pin_fraction_session: 1.0, pin_fraction_global: 1.0}\n"
    "report: {per_tier: all}\n"
)  # the test client reads where KV came from


@pytest.fixture(scope="module", params=["redis", "disk"])
def tier(request):
    # Deadline 10 s, not 2 s: see test_g3_sharing's ``tiers``.
    common = {"namespace": f"moves-{uuid.uuid4().hex[:8]}", "timeout_s": 10.0}
    if request.param == "disk":  # the embedded G3: a directory, no service
        return {
            "type": "DiskTier",
            "module_path": "sessionkv.tiers.g3.backends.disk",
            "path": request.getfixturevalue("g3_disk"),
            "max_bytes": 1 << 30,
            **common,
        }
    return {
        "type": "RedisTier",
        "module_path": "sessionkv.tiers.g3.backends.redis",
        "url": request.getfixturevalue("redis_url"),
        **common,
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tier):
    d = tmp_path_factory.mktemp("moves")
    (d / "secret").write_bytes(SECRET)
    (d / "tiers.yaml").write_text(POLICY + f"trust: {{secret_file: {d / 'secret'}}}\n")
    engine_id = new_engine_id()
    llm = tiny_llm(
        kv_transfer_config(
            engine_id,
            cpu_bytes=G2_CHUNKS * CHUNK_BYTES,
            secondary_tiers=[tier],
            sessionkv={"policy_file": str(d / "tiers.yaml")},
        )
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    remove_offload_region(engine_id)


def engine_id(llm):
    return llm.llm_engine.vllm_config.kv_transfer_config.engine_id


def client(llm):
    control = llm.llm_engine.engine_core.engine_core.scheduler.connector.control
    return HintClient(control.endpoint, SECRET)


def hint(c, verb, session, **kw):
    return control_hint(c, verb, session, **kw)


def engine_b(tmp_path, tier, name, keys=None, wait=False, fetch=()):
    """Engine B in its own process: G1 and G2 poisoned, a Prefetch of A's
    chunk ``keys`` over its control channel (its final outcome awaited or
    not), or the ``fetch`` requests, then prompt ``name``."""
    (tmp_path / "secret").write_bytes(SECRET)
    policy = POLICY + f"trust: {{secret_file: {tmp_path / 'secret'}}}\n"
    spec = {
        "model": TINY,
        "block_size": 32,
        "tiers": [tier],
        "prompts": [P[name]],
        "poison": True,
        "policy": policy,
        "fetch": [{**f, "secret": SECRET.hex()} for f in fetch],
    }
    if keys is not None:
        spec["prefetch"] = {"keys": [k.hex() for k in keys], "secret": SECRET.hex(), "wait": wait}
    return engine_process(tmp_path, spec)


def test_demote_copies_to_g3_and_lets_the_g2_copy_go_first(engine):
    a = engine
    ref = cold(a, "S", "T")
    for demoted in (False, True):  # the same run without, then with the hint
        assert a.reset_prefix_cache(reset_connector=True)
        run(a, "T", session="t")  # T older than S; both in G2
        run(a, "S", session="s")
        if demoted:
            with client(a) as c:
                first, last, moved = hint(c, "demote", "s")
            assert (first.status, last.status, last.blocks_affected) == ("deferred", "accepted", 6)
            assert moved.src == "G2" and moved.dst == "G3" and len(moved.keys) == 6
        run(a, "F")  # 6 new chunks: 6 must leave a full G2
        kept = (in_g2(a, "S"), in_g2(a, "T"))
        reset_g1(a)
        tok, lps, rep = run(a, "S", session="s")
        assert tok == ref["S"][0] and lps == ref["S"][1]
        if demoted:  # S went first although T is older; S's next turn reads G3
            g3 = a.llm_engine.engine_core.engine_core.scheduler.connector.manager.secondary_tiers[0]
            assert kept == (0, 6) and (rep.blocks.g2, rep.blocks.g3) == (0, 6), (
                f"G3 trips: {g3.guard.trips}"
            )
        else:  # LRU: T goes; S stays in G2, nothing in G3
            assert kept == (6, 0) and (rep.blocks.g2, rep.blocks.g3) == (6, 0)


def test_prefetch_promotes_from_g3_on_an_idle_engine(engine):
    a = engine
    ref = cold(a, "L")
    run(a, "L", session="l")
    with client(a) as c:
        assert hint(c, "share", "l", destination="self")[1].status == "accepted"
        for prefetched in (False, True):
            run(a, "F")
            run(a, "G")  # 12 new chunks: L is only in G3 now
            assert in_g2(a, "L") == 0
            if prefetched:
                poison_g2(engine_id(a))
                first, last, moved = hint(c, "prefetch", "l")
                assert (first.status, last.status, last.blocks_affected) == (
                    "deferred",
                    "accepted",
                    6,
                )
                assert moved.src == "G3" and moved.dst == "G2" and len(moved.keys) == 6
                assert in_g2(a, "L") == 6  # loadable before any step
            reset_g1(a)
            tok, lps, rep = run(a, "L", session="l")
            assert tok == ref["L"][0] and lps == ref["L"][1]
            if prefetched:  # no promotion at request time: G2 served it
                assert (rep.blocks.g2, rep.blocks.g3) == (6, 0)
            else:
                assert (rep.blocks.g2, rep.blocks.g3) == (0, 6)
        again = hint(c, "prefetch", "l")[0]  # resident: a no-op
        assert (again.status, again.reason) == ("accepted", "already in G2")
        run(a, "F")
        run(a, "G")  # L only in G3 again
        # Nothing to copy: the backend is asked whether the objects are still
        # there, and the transfer event names them.
        first, shared, ev = hint(c, "share", "l", destination="b")
        assert first.status == "deferred"
        assert (shared.status, shared.reason) == ("accepted", "already in G3")
        assert (ev.hint_id, ev.keys, len(ev.already)) == (shared.hint_id, [], 6)


def test_share_b_serves_a_prefix_it_never_computed(engine, tier, tmp_path):
    a = engine
    ref = cold(a, "H")
    run(a, "H", session="h")
    with client(a) as c:
        first, last, moved = hint(c, "share", "h", destination="b")
    assert (first.status, last.status) == ("deferred", "accepted") and len(moved.keys) == 6
    assert moved.hint_id == first.hint_id
    # B has never seen H: the keys come from A's transfer event.
    out = engine_b(tmp_path, tier, "H", moved.keys, wait=True)
    assert out["prefetch"] == [["deferred", 0], ["accepted", 6]]
    (run_b,) = out["runs"]
    assert run_b["tokens"] == ref["H"][0]
    assert [{int(t): v for t, v in s.items()} for s in run_b["logprobs"]] == ref["H"][1]
    assert run_b["report"]["blocks"]["g2"] == 6 and run_b["report"]["tokens"]["recomputed"] == 8


def test_kv_fetch_copies_blocks_a_source_engine_holds(engine, tier, tmp_path):
    """KVCR's kv.fetch on B names A's blocks by 64-bit hashes and A's control
    endpoint: A resolves and publishes them, B prefetches them."""
    a = engine
    ref = cold(a, "K")
    run(a, "K", session="k")
    hashes = [alias64(k) for k in keys_of(a, P["K"])]
    source = a.llm_engine.engine_core.engine_core.scheduler.connector.control.endpoint
    out = engine_b(
        tmp_path,
        tier,
        "K",
        fetch=[
            {"id": "unknown", "hashes": [1, 2, 3], "source": source},
            {"id": "fetch-k", "hashes": hashes, "source": source},
        ],
    )
    unknown, fetched = out["fetch"]
    assert unknown[1] == ["missing", 0, "the source holds none of the blocks"]
    assert fetched == [["deferred", 0, f"fetching from {source}"], ["accepted", 6, ""]]
    (run_b,) = out["runs"]
    assert run_b["tokens"] == ref["K"][0]
    assert [{int(t): v for t, v in s.items()} for s in run_b["logprobs"]] == ref["K"][1]
    assert run_b["report"]["blocks"]["g2"] == 6 and run_b["report"]["tokens"]["recomputed"] == 8


@pytest.mark.parametrize("name", ["X", "Y"])
def test_a_request_racing_a_prefetch_never_reads_half_a_copy(engine, tier, tmp_path, name):
    a = engine
    ref = cold(a, name)
    run(a, name, session=name)
    with client(a) as c:
        _, last, moved = hint(c, "share", name, destination="b")
    assert last.status == "accepted"
    # B serves at once, while its copy runs: it waits for it or recomputes.
    out = engine_b(tmp_path, tier, name, moved.keys, wait=False)
    assert out["prefetch"][0][0] == "deferred"
    (run_b,) = out["runs"]
    assert run_b["tokens"] == ref[name][0]
    assert [{int(t): v for t, v in s.items()} for s in run_b["logprobs"]] == ref[name][1]
    blocks = run_b["report"]["blocks"]
    assert blocks["g2"] + blocks["recomputed"] == 7, blocks


def test_pin_holds_the_session_in_g3_too(engine, tier):
    a = engine
    run(a, "T", session="pinned")
    with client(a) as c:
        _, last, moved = hint(c, "share", "pinned", destination="self")
        assert last.status == "accepted"
        first, last, _ = hint(c, "pin", "pinned", ttl_s=1.5)
    assert (first.status, last.status, last.blocks_affected) == ("deferred", "accepted", 6), last
    g3 = a.llm_engine.engine_core.engine_core.scheduler.connector.manager.secondary_tiers[0]
    state = g3_pins(tier, [g3.name(k) for k in moved.keys])
    assert state() == ["pinned"] * 6  # not evictable while pinned
    deadline = time.monotonic() + 10
    while state() != ["evictable"] * 6:  # evictable again after
        assert time.monotonic() < deadline
        time.sleep(0.1)


def g3_pins(tier, names):
    """Per chunk, "pinned" where the backend holds it from eviction now, else
    "evictable": Redis, objects without a TTL (``volatile-lru`` evicts only
    keys with one); the disk, an object whose mtime is in the future (its
    evictor skips those). A chunk missing an object raises."""
    if tier["type"] == "DiskTier":
        import os

        from sessionkv.tiers.g3.backends.disk import DiskBackend

        b = DiskBackend(tier["path"], tier["max_bytes"])
        b.close()
        return lambda: [
            "pinned" if os.stat(b.path_of(n)).st_mtime > time.time() else "evictable" for n in names
        ]
    import redis

    r = redis.Redis.from_url(tier["url"])

    def ttls():
        out = []
        for n in names:
            t = {r.ttl(n + sfx) for sfx in ("", ".sum")}
            assert -2 not in t and len(t) == 1 or min(t) > 0, (n, t)
            out.append("pinned" if t == {-1} else "evictable")
        return out

    return ttls


def test_prefetches_past_the_transfer_capacity_wait_then_finish(engine):
    from sessionkv.devtools.engines import final_outcome
    from sessionkv.hints import envelope, hint_action

    a = engine
    run(a, "S", session="cap")
    with client(a) as c:
        _, last, moved = hint(c, "share", "cap", destination="self")
        assert last.status == "accepted"
        run(a, "F")
        run(a, "G")  # S's chunks only in G3 now
        after = c.events(after=0, limit=1).next_seq - 1
        # One request, six prefetches of one chunk each: four copies at once.
        firsts = c.hints(envelope(*[hint_action("prefetch", keys=[k]) for k in moved.keys]))
        assert [(o.status, o.reason) for o in firsts] == [
            ("deferred", "copying 1 chunks from G3")
        ] * 4 + [("deferred", "waiting for transfer capacity")] * 2
        finals = [final_outcome(c, o.hint_id, after)[0] for o in firsts]
    assert [(o.status, o.blocks_affected) for o in finals] == [("accepted", 1)] * 6
    assert in_g2(a, "S") == 6
