"""bench/gpu_check.py on a machine without a GPU: it refuses clearly, and it
needs nothing but PyTorch and the standard library (it runs on bare GPU
machines without vLLM or sessionkv). Its figures come from a GPU run
(bench/README.md); the suite never imports it nor needs a device."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_without_a_cuda_device_it_exits_2_and_says_why(tmp_path):
    out = tmp_path / "gpu.json"
    # No device visible, on any machine (CUDA_VISIBLE_DEVICES hides a GPU too).
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "gpu_check: no CUDA device" in r.stderr
    assert not out.exists()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("sessionkv_gpu_check_")]


def test_it_imports_only_torch_and_the_standard_library():
    found = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    assert found - set(sys.stdlib_module_names) == {"torch"}
