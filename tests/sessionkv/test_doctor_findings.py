"""sessionkv doctor's findings from probe answers (the engines' side is in
tests/e2e/test_doctor_http.py), and whether /dev/shm holds G2 (the real
/dev/shm, and a real directory where a file plays a G2 region)."""

import json
import shutil

import pytest

from sessionkv.doctor import SHM, compare, shm_findings
from sessionkv.doctor import main as doctor_main


def answer(**kw):
    a = {
        "block_hashes": ["aa", "bb"],
        "block_size": 32,
        "hash_algo": "sha256",
        "hash_root": "r0",
        "pythonhashseed": "0",
        "g3": [{"tier": "RedisTier", "objects": "ns/fp0/", "error": ""}],
    }
    return {**a, **kw}


def errors(found):
    return [(f.engine, f.what) for f in found if f.level == "error"]


def test_matching_engines_give_one_ok():
    found = compare({"a": answer(), "b": answer()})
    assert [(f.level, f.engine) for f in found] == [("ok", "a, b")]


def test_each_cause_is_named_once_with_its_fix():
    found = compare(
        {
            "a": answer(),
            "bs": answer(block_size=64, block_hashes=["x"]),
            "algo": answer(hash_algo="xxhash", hash_root="r1", block_hashes=["y"]),
            "seed": answer(hash_root="r2", pythonhashseed="1", block_hashes=["z"]),
            "salt": answer(block_hashes=["w"]),
            "model": answer(g3=[{"tier": "RedisTier", "objects": "ns/fp9/", "error": ""}]),
        }
    )
    assert errors(found) == [
        ("bs", "block size 64 != 32 (vs a)"),
        ("algo", "hash function xxhash != sha256 (vs a)"),
        ("seed", "block-hash root differs: PYTHONHASHSEED '1' != '0' (vs a)"),
        (
            "salt",
            "the probe's block hashes differ with the same hash settings (extra keys: "
            "LoRA adapter, cache_salt, multimodal inputs) (vs a)",
        ),
        (
            "model",
            "G3 tier RedisTier names objects ns/fp9/* != ns/fp0/*: another model, "
            "dtype, layout or namespace (vs a)",
        ),
    ]
    assert all(f.fix for f in found)


def test_an_unset_seed_warns_and_a_dead_tier_is_an_error():
    found = compare(
        {
            "a": answer(
                pythonhashseed=None,
                g3=[{"tier": "RedisTier", "objects": "ns/fp0/", "error": "RedisTier is down"}],
            )
        }
    )
    assert [(f.level, f.what.split(":")[0]) for f in found] == [
        ("warning", "PYTHONHASHSEED is not set"),
        ("error", "G3 tier RedisTier does not answer"),
    ]


# --- /dev/shm can hold G2 (sessionkv doctor --kv-transfer-config) -------------

SHM_TOTAL = shutil.disk_usage(SHM).total


def kv_config(**extra):
    return json.dumps(
        {
            "kv_connector": "SessionTierConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )


def test_a_shm_smaller_than_g2_is_an_error_naming_both_sizes_and_the_fix():
    found = shm_findings(SHM_TOTAL + 1)
    assert [(f.level, f.engine) for f in found] == [("error", SHM)]
    assert f"({SHM_TOTAL + 1} bytes)" in found[0].what and "Insufficient space" in found[0].what
    assert "--shm-size" in found[0].fix and "medium: Memory" in found[0].fix


def test_g2_that_fits_is_ok_and_engines_on_the_host_add_up():
    assert [f.level for f in shm_findings(2**20)] == ["ok"]
    half = SHM_TOTAL // 2 + 1
    assert "error" not in [f.level for f in shm_findings(half, engines=1)]
    found = shm_findings(half, engines=2)
    assert [f.level for f in found] == ["error"]
    assert f"({half} bytes x 2 engines)" in found[0].what


def test_too_little_free_space_warns_and_names_the_regions_already_there(tmp_path):
    # A real file under a G2 region's name, 8 MiB of written pages.
    (tmp_path / "vllm_offload_engine-a.mmap").write_bytes(b"\1" * (8 << 20))
    usage = shutil.disk_usage(tmp_path)
    need = (usage.free + usage.total) // 2  # fits the filesystem, not its free space
    found = shm_findings(need, directory=str(tmp_path))
    assert [f.level for f in found] == ["warning"]
    assert "1 G2 region(s) already there hold 8 MiB" in found[0].what


def test_the_cli_reads_g2_from_the_engines_flag_or_its_policy_file(tmp_path, capsys):
    assert doctor_main(["--kv-transfer-config", kv_config(cpu_bytes_to_use=SHM_TOTAL + 1)]) == 1
    assert f"[error] {SHM}: {SHM} holds" in capsys.readouterr().out
    policy = tmp_path / "tiers.yaml"
    policy.write_text("version: 1\ntiers: {g2_bytes: 1048576}\n")
    config = kv_config(sessionkv={"policy_file": str(policy)})
    assert doctor_main(["--kv-transfer-config", config, "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["level"] == "ok" and "(1048576 bytes)" in line["what"]


def test_a_configuration_vllm_would_refuse_exits_2_naming_the_key(capsys):
    assert doctor_main(["--kv-transfer-config", kv_config()]) == 2
    assert "cpu_bytes_to_use is required" in capsys.readouterr().err
    assert doctor_main(["--kv-transfer-config", "{"]) == 2
    assert "not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        doctor_main([])
    assert e.value.code == 2
