"""Engine steps and outputs while a G3 backend fails (the scenario in
tests/e2e/g3_faults.py): normal, then each backend process stopped (SIGSTOP),
continued, killed and restarted.

    scripts/netns .venv/bin/python bench/g3_faults.py --json OUT [--backend mooncake|redis|lmcache]

scripts/netns gives it a private network namespace (
``unshare -n`` with a veth address in SESSIONKV_LAN_ADDRESS). Keys:
``{backend: {"phases": {label: {"requests", "steps", "max_step_s",
"median_step_s", "blocks": {g1, g2, g3, recomputed}, "wall_s"}}, "wrong": [...],
"worst_outage_step_s", "normal_max_step_s", "ratio"}}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--backend", choices=["mooncake", "redis", "lmcache"], action="append")
    args = ap.parse_args()
    from sessionkv.devtools.engines import use_engine_env
    from sessionkv.devtools.g3_faults import BACKENDS, scenario

    use_engine_env()

    result = {}
    for backend in args.backend or BACKENDS:
        with tempfile.TemporaryDirectory() as logs:
            out = scenario(Path(logs), backend)
        ph = out["phases"]
        outages = [p for label, p in ph.items() if label.endswith(("_stopped", "_killed"))]
        out["normal_max_step_s"] = ph["normal"]["max_step_s"]
        out["worst_outage_step_s"] = max(p["max_step_s"] for p in outages)
        out["ratio"] = out["worst_outage_step_s"] / out["normal_max_step_s"]
        result[backend] = out
        print(backend, json.dumps({k: v for k, v in out.items() if k != "phases"}))
        for label, p in ph.items():
            print(
                f"  {label:24s} max {p['max_step_s'] * 1e3:7.1f} ms  median "
                f"{p['median_step_s'] * 1e3:6.2f} ms  blocks {p['blocks']}  "
                f"wall {p['wall_s']:.1f} s"
            )
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
