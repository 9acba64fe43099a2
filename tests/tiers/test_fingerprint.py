"""The G3 fingerprint: every factor that changes K/V changes it, the others
do not; weights are digested by content (cached by path, size and mtime),
hub ids through the local Hugging Face cache; LoRA and function
``hf_overrides`` are refused; ``doctor`` names the field that differs."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from sessionkv.connectors.startup import model_identity
from sessionkv.devtools.engines import TINY
from sessionkv.devtools.g3_spec import standalone_identity
from sessionkv.doctor import _pair
from sessionkv.tiers.g3.fingerprint import (
    FingerprintError,
    fingerprint,
    identity_fields,
    weights_digest,
)
from sessionkv.tiers.g3.spec import IDENTITY_KEY, TopologyError, spec_identity

BASE = dict(
    weights="w",
    dtype="bfloat16",
    quantization=None,
    kv_cache_dtype="auto",
    kv_scales="checkpoint",
    kv_skip_layers=[],
    hf_overrides={},
    block_size=32,
    blocks_per_chunk=1,
    layout="NHD",
    tp=1,
    pp=1,
    pcp=1,
    dcp=1,
    none_hash=b"\1" * 32,
    chunk_bytes=4096,
)
CHANGED = dict(
    weights="w2",
    dtype="float16",
    quantization="fp8",
    kv_cache_dtype="fp8_e4m3",
    kv_scales="computed",
    kv_skip_layers=["model.layers.0.attn"],
    hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    block_size=64,
    blocks_per_chunk=4,
    layout="HND",
    tp=2,
    pp=2,
    pcp=2,
    dcp=2,
    none_hash=b"\2" * 32,
    chunk_bytes=8192,
)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_factor_changes_the_fingerprint(field):
    assert fingerprint(identity_fields(**{**BASE, field: CHANGED[field]})) != fingerprint(
        identity_fields(**BASE)
    )


def model_dir(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_weights_are_digested_by_content_and_cached_by_path_size_and_mtime(tmp_path):
    """Two checkpoints of one size that differ in one byte far from the ends
    (the old digest sampled 12 MiB per file and called them equal) differ; a
    second start reads the digest from the cache, not the file."""
    size = 40 << 20
    a = bytearray(size)
    b = bytearray(size)
    b[size // 4] = 1
    cache = tmp_path / "digests.json"
    da = weights_digest(str(model_dir(tmp_path / "a", bytes(a))), cache_path=cache)
    db = weights_digest(str(model_dir(tmp_path / "b", bytes(b))), cache_path=cache)
    assert da != db and cache.is_file()
    f = tmp_path / "b" / "model.safetensors"
    st = f.stat()
    f.write_bytes(bytes(a))  # same size, mtime put back:
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(str(tmp_path / "b"), cache_path=cache) == db  # from the cache
    assert weights_digest(str(tmp_path / "b"), cache_path=None) == da  # read again


def hub_model(cache: Path, repo: str, commit: str, weights: bytes, ref: str = "main") -> None:
    d = cache / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / ref).write_text(commit)
    snap = d / "snapshots" / commit
    model_dir(snap, weights)


def test_a_hub_id_is_resolved_through_the_local_cache_to_its_revision(tmp_path):
    """Two revisions of one repository are two models (the old fingerprint
    named both ``id:<repo>@default``); an id not in the cache is refused."""
    hub = tmp_path / "hub"
    hub_model(hub, "org/m", "a" * 40, b"one" * 1000)
    hub_model(hub, "org/m", "b" * 40, b"two" * 1000, ref="v2")
    main = weights_digest("org/m", None, cache_path=None, hub_cache=str(hub))
    v2 = weights_digest("org/m", "v2", cache_path=None, hub_cache=str(hub))
    by_commit = weights_digest("org/m", "b" * 40, cache_path=None, hub_cache=str(hub))
    assert main != v2 and v2 == by_commit
    with pytest.raises(FingerprintError, match="not in the local Hugging Face cache"):
        weights_digest("org/other", None, cache_path=None, hub_cache=str(hub))


def spec(par=None, **model):
    cfg = SimpleNamespace(
        model=SimpleNamespace(name=TINY, dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=SimpleNamespace(
            **{"tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, **(par or {})}
        ),
        kv_cache_layout="NHD",
        canonical_layout=False,
        replicated_layout=False,
    )
    return SimpleNamespace(config=cfg, extra_config={IDENTITY_KEY: standalone_identity(**model)})


def test_g3_refuses_lora_and_function_overrides_and_a_spec_without_identity():
    assert spec_identity(spec(), 4096)["weights"]
    with pytest.raises(FingerprintError, match="LoRA"):
        spec_identity(spec(lora=True), 4096)
    with pytest.raises(FingerprintError, match="hf_overrides"):
        spec_identity(spec(hf_overrides=None), 4096)
    bare = spec()
    bare.extra_config = {}
    with pytest.raises(FingerprintError, match="SessionTierConnector"):
        spec_identity(bare, 4096)


@pytest.mark.parametrize(
    "par, model, setting",
    [
        ({"pcp_size": 2}, {}, "prefill_context_parallel_size=2"),
        ({"dcp_size": 2}, {}, "decode_context_parallel_size=2"),
        ({"tp_size": 2}, {"nnodes": 2}, "nnodes"),
        ({"tp_size": 2, "pp_size": 2}, {"executor": "ray"}, "distributed_executor_backend=ray"),
    ],
)
def test_g3_refuses_topologies_it_would_serve_wrongly(par, model, setting):
    with pytest.raises(TopologyError, match=setting):
        spec_identity(spec(par, **model), 4096)


def test_g3_accepts_tensor_parallel_ranks_on_one_node():
    assert spec_identity(spec({"tp_size": 4}), 4096)["parallel"]["tp"] == 4


def engine_config(**kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=TINY, **kw).create_engine_config()


@pytest.mark.platform
def test_model_identity_from_a_real_vllm_config():
    """Settings that do not touch K/V leave the identity alone; overrides,
    the revision and the KV dtype change it."""
    base = model_identity(engine_config())
    assert model_identity(engine_config(max_num_seqs=7, max_model_len=256)) == base
    assert not base["lora"] and base["hf_overrides"] == {} and base["nnodes"] == 1
    rope = model_identity(engine_config(hf_overrides={"rope_theta": 5e5}))
    assert rope["hf_overrides"] == {"rope_theta": 5e5}
    assert model_identity(engine_config(revision="v2"))["revision"] == "v2"
    assert model_identity(engine_config(kv_cache_dtype="fp8"))["kv_cache_dtype"] == "fp8"


def test_doctor_names_the_field_that_differs():
    def answer(quant):
        ident = {"weights": "w", "quantization": quant}
        return {
            "block_size": 32,
            "hash_algo": "sha256",
            "hash_root": "r",
            "pythonhashseed": "0",
            "block_hashes": ["h"],
            "g3": [{"tier": "redis", "objects": f"ns/{quant}/", "identity": ident, "error": None}],
        }

    (f,) = _pair("e0", answer(None), "e1", answer("fp8"))
    assert "fingerprint fields differ: quantization ('fp8' != None)" in f.what, f.what
    assert "weights" not in f.what
