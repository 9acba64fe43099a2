"""Overlap routing's parts: the router's block hashes against vLLM's own
request block hasher, probe verification, the per-engine index fed by events,
and the routing rule with overlap scores."""

import pytest

from sessionkv.devtools.keys import block_key
from sessionkv.events import Association, Eviction, Residency, Transfer
from sessionkv.router import parse_config
from sessionkv.router.overlap import PROBE_TOKENS, BlockHasher, OverlapIndex, ProbeMismatch, score


def vllm_hashes(tokens, block_size, algo, salt=None):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    req = Request(
        "r",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=kv_cache_utils.get_request_block_hasher(block_size, fn),
    )
    out = [bytes(h) for h in req.block_hashes], bytes(kv_cache_utils.NONE_HASH)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))  # vLLM's default again
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_hashes_equal_vllms(algo, salt):
    tokens = PROBE_TOKENS + [3, 1, 4]  # a partial last block is not hashed
    want, root = vllm_hashes(tokens, 16, algo, salt)
    assert len(want) == len(tokens) // 16
    assert BlockHasher(16, algo, root).hashes(tokens, salt) == want


def probe_answer(**change):
    want, root = vllm_hashes(PROBE_TOKENS, 32, "sha256")
    return {
        "block_hashes": [h.hex() for h in want],
        "block_size": 32,
        "hash_algo": "sha256",
        "hash_root": root.hex(),
        **change,
    }


def test_probe_verifies_or_refuses():
    hasher = BlockHasher.from_probe(probe_answer(), PROBE_TOKENS)
    assert (hasher.block_size, hasher.algo) == (32, "sha256")
    assert hasher.keys(PROBE_TOKENS[:64])[1][-4:] == b"\0\0\0\0"  # group 0
    for change, message in [
        ({"hash_root": "00" * 32}, "differ"),
        ({"block_size": 16}, "differ"),
        ({"hash_algo": "xxhash"}, "not reproduced"),
        ({"block_hashes": []}, "differ"),
        ({"hash_root": "zz"}, "incomplete"),
    ]:
        with pytest.raises(ProbeMismatch, match=message):
            BlockHasher.from_probe(probe_answer(**change), PROBE_TOKENS)
    with pytest.raises(ProbeMismatch, match="incomplete"):
        BlockHasher.from_probe({"block_size": 32}, PROBE_TOKENS)


def test_index_follows_events():
    keys = [block_key(i) for i in range(1, 9)]
    idx = OverlapIndex(g1_keys=2)
    assert idx.held(keys) == (0, 0)
    idx.apply(Association(session_id="s", op="extend", tier="G1", blocks=3, frontier=keys[2]))
    idx.apply(Residency(tier="G2", keys=[keys[1], keys[4]]))
    assert idx.held(keys) == (3, 5)
    assert idx.held(keys[:4]) == (3, 2)  # a shorter prompt: its own depth
    idx.apply(Eviction(tier="G2", keys=[keys[4]]))
    idx.apply(Residency(tier="G2", keys=[keys[1]], present=False))
    assert idx.held(keys) == (3, 0)
    idx.apply(Transfer(src="G3", dst="G2", keys=[keys[6]]))
    idx.apply(Transfer(src="G2", dst="G3", keys=[keys[7]]))  # G3 is shared: not scored
    assert idx.held(keys) == (3, 7)
    idx.apply(Eviction(tier="G2", keys=[], reason="reset"))
    for k in keys[:3]:  # G1: the 2 newest frontiers kept
        idx.apply(Association(session_id="t", op="extend", tier="G1", frontier=k))
    assert idx.held(keys[:1]) == (0, 0) and idx.held(keys) == (3, 0)
    idx.apply(Association(session_id="t", op="end"))
    assert score((3, 7), 0.5) == 5.0 and score((3, 0), 0.5) == 3.0


def test_routing_config_keys(tmp_path):
    (tmp_path / "key").write_bytes(b"k" * 32)
    doc = {
        "secret_file": str(tmp_path / "key"),
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "workers": [{"name": "a", "url": "http://127.0.0.1:1", "control": "tcp://x:1"}],
    }
    r = parse_config(doc).routing
    assert (r.overlap, r.overlap_g2_weight, r.retry) == (True, 0.5, True)
    r = parse_config(
        {**doc, "routing": {"overlap": False, "overlap_g2_weight": 0.25, "retry": False}}
    ).routing
    assert (r.overlap, r.overlap_g2_weight, r.retry) == (False, 0.25, False)
    with pytest.raises(ValueError, match="routing.retry must be true or false"):
        parse_config({**doc, "routing": {"retry": 1}})


def test_plain_workers(tmp_path):
    (tmp_path / "key").write_bytes(b"k" * 32)
    doc = {
        "secret_file": str(tmp_path / "key"),
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "workers": [{"name": "a", "url": "http://127.0.0.1:1", "plain": True}],
    }
    assert parse_config(doc).workers[0].plain
    with pytest.raises(ValueError, match="a plain worker has no control channel"):
        parse_config({**doc, "workers": [{**doc["workers"][0], "control": "tcp://x:1"}]})
    with pytest.raises(ValueError, match="one of them"):
        parse_config({**doc, "workers": [{"name": "a", "url": "http://x", "plain": False}]})
