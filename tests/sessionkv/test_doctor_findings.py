"""sessionkv doctor's findings from probe answers (the engines' side is in
tests/e2e/test_doctor_http.py)."""

from sessionkv.doctor import compare


def answer(**kw):
    a = {"block_hashes": ["aa", "bb"], "block_size": 32, "hash_algo": "sha256",
         "hash_root": "r0", "pythonhashseed": "0",
         "g3": [{"tier": "RedisTier", "objects": "ns/fp0/", "error": ""}]}
    return {**a, **kw}


def errors(found):
    return [(f.engine, f.what) for f in found if f.level == "error"]


def test_matching_engines_give_one_ok():
    found = compare({"a": answer(), "b": answer()})
    assert [(f.level, f.engine) for f in found] == [("ok", "a, b")]


def test_each_cause_is_named_once_with_its_fix():
    found = compare({"a": answer(),
                     "bs": answer(block_size=64, block_hashes=["x"]),
                     "algo": answer(hash_algo="xxhash", hash_root="r1", block_hashes=["y"]),
                     "seed": answer(hash_root="r2", pythonhashseed="1", block_hashes=["z"]),
                     "salt": answer(block_hashes=["w"]),
                     "model": answer(g3=[{"tier": "RedisTier", "objects": "ns/fp9/",
                                          "error": ""}])})
    assert errors(found) == [
        ("bs", "block size 64 != 32 (vs a)"),
        ("algo", "hash function xxhash != sha256 (vs a)"),
        ("seed", "block-hash root differs: PYTHONHASHSEED '1' != '0' (vs a)"),
        ("salt", "the probe's block hashes differ with the same hash settings (extra keys: "
                 "LoRA adapter, cache_salt, multimodal inputs) (vs a)"),
        ("model", "G3 tier RedisTier names objects ns/fp9/* != ns/fp0/*: another model, "
                  "dtype, layout or namespace (vs a)")]
    assert all(f.fix for f in found)


def test_an_unset_seed_warns_and_a_dead_tier_is_an_error():
    found = compare({"a": answer(pythonhashseed=None,
                                 g3=[{"tier": "RedisTier", "objects": "ns/fp0/",
                                      "error": "RedisTier is down"}])})
    assert [(f.level, f.what.split(":")[0]) for f in found] == [
        ("warning", "PYTHONHASHSEED is not set"), ("error", "G3 tier RedisTier does not answer")]
