"""Cross-engine sharing through Mooncake Store on real vLLM (tiny model).

Each engine is its own process (``g3_engine.py``); the standalone store
process holds the objects after an engine exits. Engines that read from G3
start with G1 and G2 full of garbage, so only a correct load gives the cold
reference's tokens and logprobs.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines import MODELS, TINY
from sessionkv.services import lan_address

HERE = Path(__file__).parent
RNG = np.random.default_rng(11)
# 200 tokens: 6 full blocks and a partial one (see test_pin_retain).
P = RNG.integers(10, 4000, 200).tolist()


@pytest.fixture(scope="module")
def tiers(mooncake):
    from uuid import uuid4
    return [{"type": "MooncakeTier", "module_path": "sessionkv.tiers.mooncake",
             "master": mooncake.master, "metadata_server": mooncake.metadata_url,
             "local_hostname": lan_address(), "namespace": f"e2e-{uuid4().hex[:8]}"}]


def engine(tmp_path, tiers, prompts, model=TINY, poison=False, block_size=32, policy=None):
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"model": model, "block_size": block_size, "tiers": tiers,
                                "prompts": prompts, "poison": poison, "policy": policy}))
    p = subprocess.run([sys.executable, str(HERE / "g3_engine.py"), str(spec), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())


def same(a, b):
    return (a["tokens"], a["logprobs"]) == (b["tokens"], b["logprobs"])


@pytest.fixture(scope="module")
def first(tiers, tmp_path_factory):
    """Engine 1: serves P cold, offloads it down to G3, exits."""
    (run,) = engine(tmp_path_factory.mktemp("e1"), tiers, [P])
    assert run["report"]["blocks"]["recomputed"] == 7
    return run


def test_engine_2_loads_engine_1s_prefix_from_mooncake(first, tiers, tmp_path):
    (run,) = engine(tmp_path, tiers, [P], poison=True)
    assert run["report"]["blocks"]["g3"] == 6 and run["report"]["tokens"]["recomputed"] == 8
    assert same(run, first)


def test_corrupted_objects_are_recomputed_exactly(first, tiers, mooncake, tmp_path):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    assert store.setup(lan_address(), mooncake.metadata_url, 0, 16 << 20, "tcp", "",
                       mooncake.master) == 0
    names = first["objects"]
    assert len(names) == 6 and store.batch_is_exist(names) == [1] * 6
    rng = np.random.default_rng(3)
    for name in names:
        size = store.get_size(name)
        assert store.remove(name, True) == 0
        assert store.put(name, rng.integers(0, 256, size, dtype=np.uint8).tobytes()) == 0
    store.close()
    (run,) = engine(tmp_path, tiers, [P], poison=True)
    assert run["report"]["blocks"]["g3"] == 0 and run["report"]["tokens"]["recomputed"] == 200
    assert same(run, first)


def test_another_model_with_the_same_tokenizer_misses(first, tiers, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    other = tmp_path / "tiny-other"
    shutil.copytree(MODELS / "tiny", other)
    (weights,) = other.glob("*.safetensors")
    state = load_file(weights)
    name = next(k for k in state if "layers.0" in k and "proj" in k)
    state[name] = state[name] + 0.05 * torch.randn_like(state[name])
    save_file(state, weights, metadata={"format": "pt"})
    (cold, warm) = engine(tmp_path, tiers, [P, P], model=str(other), poison=True)
    assert cold["report"]["blocks"]["g3"] == 0                 # engine 1's KV is not this model's
    assert cold["tokens"] != first["tokens"] or cold["logprobs"] != first["logprobs"]
    assert warm["report"]["blocks"]["g1"] == 6 and same(warm, cold)


def objects(mooncake, prefix):
    """Every object Mooncake holds under a prefix (the master's key list)."""
    import urllib.request
    url = f"http://127.0.0.1:{mooncake.metrics}/get_all_keys"
    keys = urllib.request.urlopen(url, timeout=5).read().decode().split()
    return [k for k in keys if k.startswith(prefix)]


def test_without_write_through_nothing_goes_down(first, tiers, mooncake, tmp_path):
    mine = first["objects"][0].rsplit("/", 1)[0] + "/"      # namespace/fingerprint/
    assert len(objects(mooncake, mine)) == 12                 # 6 chunks + 6 checksums
    quiet = [{**tiers[0], "namespace": tiers[0]["namespace"] + "-quiet"}]
    (run,) = engine(tmp_path, quiet, [P, P], policy="g3: {write_through: false}\n")[:1]
    assert same(run, first)
    assert objects(mooncake, quiet[0]["namespace"] + "/") == []
