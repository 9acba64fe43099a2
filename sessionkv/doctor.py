"""``sessionkv doctor``: why engines would not share KV, or could not start
here, with the fix.

    sessionkv doctor --engine tcp://10.0.0.5:5700 --engine tcp://10.0.0.6:5700 \\
        --secret-file router.key
    sessionkv doctor --kv-transfer-config "$KV_TRANSFER_CONFIG" [--local-engines 2]

Each engine hashes the same probe prompt through its real hashing path (the
control channel's ``probe``) and reports its hash function, block size,
block-hash root, G3 object prefix (the fingerprint) and G3 health. Engines
share KV only when they name the same prompt's blocks alike and their G3
fingerprints match; mismatched hashing (``PYTHONHASHSEED``, hash function,
block size, extra keys such as LoRA or ``cache_salt``) is the most common
reason cross-node sharing never hits. Findings compare every engine with the
first one.

With ``--kv-transfer-config`` (the engine's own flag, run on its host) it
checks that /dev/shm can hold G2: vLLM maps G2 from one file there per engine
(``/dev/shm/vllm_offload_<engine_id>.mmap``, ``cpu_bytes_to_use`` or the
policy file's ``tiers.g2_bytes`` rounded down to whole chunks; an engine's
tensor- and pipeline-parallel workers share it, each data-parallel rank is an
engine of its own). An error when the filesystem is smaller than G2 times the
engines on the host (Docker gives 64 MiB by default); a warning when only its
free space is, naming the G2 regions already there (running engines hold
theirs). One ``statvfs`` and one directory listing.

Exit status 0 when nothing is wrong (warnings allowed), 1 otherwise, 2 when
the arguments or the configuration are wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Any

from sessionkv.client import ControlError, HintClient
from sessionkv.config import parse_extra_config, vllm_extra_config

# 16 blocks of 32 tokens; any engine block size up to 512 still gets a full block.
PROBE_TOKENS = [(7919 * i) % 30_000 + 10 for i in range(512)]
# Where vLLM maps G2 (SharedOffloadRegion, fixed in vLLM 0.32 and 0.33), and its files' names.
SHM = "/dev/shm"
REGION_PREFIX = "vllm_offload_"


@dataclass(frozen=True)
class Finding:
    """One thing found: ``ok`` or an ``error`` that says what is wrong and the fix."""

    level: str  # "ok" | "error" | "warning"
    engine: str
    what: str
    fix: str = ""


def ask(
    engines: list[str], secret: bytes, timeout_s: float = 10.0
) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    """Each engine's probe answer; findings for those that did not answer."""
    answers, findings = {}, []
    for url in engines:
        try:
            with HintClient(url, secret, timeout_s=timeout_s) as c:
                answers[url] = c.probe(PROBE_TOKENS)
        except ControlError as e:
            if "not authentic" in str(e):
                findings.append(
                    Finding(
                        "error",
                        url,
                        "the control channel did not authenticate with this secret",
                        "use the key in the engine's trust.secret_file",
                    )
                )
            else:
                findings.append(
                    Finding(
                        "error",
                        url,
                        f"no answer: {e}",
                        "check the endpoint (sessionkv.control.port or the "
                        "endpoint file) and that the engine runs",
                    )
                )
    return answers, findings


def compare(answers: dict[str, dict[str, Any]]) -> list[Finding]:
    """Findings from probe answers (``ask``), every engine against the first."""
    out: list[Finding] = []
    for url, a in answers.items():
        if a["pythonhashseed"] is None:
            out.append(
                Finding(
                    "warning",
                    url,
                    "PYTHONHASHSEED is not set: vLLM picks a random "
                    "block-hash root at every start, so no other engine (and not "
                    "this one after a restart) names its blocks alike",
                    "set the same PYTHONHASHSEED on every engine",
                )
            )
        for t in a["g3"]:
            if t["error"]:
                out.append(
                    Finding(
                        "error",
                        url,
                        f"G3 tier {t['tier']} does not answer: {t['error']}",
                        "check the backend service "
                        "(scripts/services status) and the tier's address",
                    )
                )
    if not answers:
        return out
    first_url, first = next(iter(answers.items()))
    for url, a in list(answers.items())[1:]:
        out += _pair(first_url, first, url, a)
    if not any(f.level == "error" for f in out):
        out.append(
            Finding(
                "ok",
                ", ".join(answers),
                f"{len(answers)} engine(s) hash the probe alike and share G3 fingerprints",
            )
        )
    return out


def _pair(u0: str, a0: dict, url: str, a: dict) -> list[Finding]:
    def mismatch(what: str, fix: str) -> Finding:
        return Finding("error", url, f"{what} (vs {u0})", fix)

    out = []
    if a["block_size"] != a0["block_size"]:
        out.append(
            mismatch(
                f"block size {a['block_size']} != {a0['block_size']}",
                "start every engine with the same --block-size",
            )
        )
    if a["hash_algo"] != a0["hash_algo"]:
        out.append(
            mismatch(
                f"hash function {a['hash_algo']} != {a0['hash_algo']}",
                "start every engine with the same --prefix-caching-hash-algo",
            )
        )
    if a["hash_root"] != a0["hash_root"] and a["hash_algo"] == a0["hash_algo"]:
        seeds = (a["pythonhashseed"], a0["pythonhashseed"])
        why = (
            f"PYTHONHASHSEED {seeds[0]!r} != {seeds[1]!r}"
            if seeds[0] != seeds[1]
            else "PYTHONHASHSEED unset"
            if seeds[0] is None
            else "another hash seed"
        )
        out.append(
            mismatch(
                f"block-hash root differs: {why}", "set the same PYTHONHASHSEED on every engine"
            )
        )
    if not out and a["block_hashes"] != a0["block_hashes"]:
        out.append(
            mismatch(
                "the probe's block hashes differ with the same hash settings "
                "(extra keys: LoRA adapter, cache_salt, multimodal inputs)",
                "send requests that should share KV with the same LoRA and cache_salt",
            )
        )
    mine = {t["tier"]: t for t in a["g3"]}
    for t in a0["g3"]:
        other = mine.get(t["tier"])
        if other is not None and other["objects"] != t["objects"] and not out:
            out.append(
                mismatch(
                    f"G3 tier {t['tier']} names objects {other['objects']}* != "
                    f"{t['objects']}*: {_differs(other, t)}",
                    "serve the same model, revision, quantization and KV dtype "
                    "with the same tier namespace",
                )
            )
    return out


def _differs(a: dict, b: dict) -> str:
    """Which fingerprint fields of two probe G3 entries differ, by name."""
    ia, ib = a.get("identity") or {}, b.get("identity") or {}
    names = sorted(k for k in set(ia) | set(ib) if ia.get(k) != ib.get(k))
    if not names:
        return "another namespace" if ia else "another model, dtype, layout or namespace"
    return "fingerprint fields differ: " + ", ".join(
        f"{k} ({ia.get(k)!r} != {ib.get(k)!r})" for k in names
    )


def g2_bytes(kv_transfer_config: str) -> int:
    """G2's size in an engine's ``--kv-transfer-config`` JSON: ``cpu_bytes_to_use``
    or its policy file's ``tiers.g2_bytes`` (the file is read and checked as the
    engine reads it). ``ValueError`` naming the key when it does not parse."""
    try:
        doc = json.loads(kv_transfer_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    extra = doc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    return vllm_extra_config(extra, parse_extra_config(extra))["cpu_bytes_to_use"]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def shm_findings(g2: int, engines: int = 1, directory: str = SHM) -> list[Finding]:
    """Whether ``directory`` can hold ``engines`` G2 regions of ``g2`` bytes each."""
    need, usage = g2 * engines, shutil.disk_usage(directory)  # statvfs
    what = (
        f"G2 needs {_size(need)} ({g2} bytes"
        + (f" x {engines} engines" if engines > 1 else "")
        + ")"
    )
    if usage.total < need:
        return [
            Finding(
                "error",
                directory,
                f"{directory} holds {_size(usage.total)} in all; "
                f"{what}: the engine refuses to start (vLLM: Insufficient space "
                f"in {directory})",
                f"give {directory} more than {_size(need)}: docker run --shm-size "
                "(or --ipc=host); Kubernetes: an emptyDir with medium: Memory and a "
                f"sizeLimit mounted at {directory}; or lower cpu_bytes_to_use "
                "(tiers.g2_bytes)",
            )
        ]
    if usage.free < need:
        held = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith(REGION_PREFIX):
                    with contextlib.suppress(OSError):  # gone meanwhile
                        held.append(entry.stat().st_blocks * 512)
        there = f"; {len(held)} G2 region(s) already there hold {_size(sum(held))}" if held else ""
        return [
            Finding(
                "warning",
                directory,
                f"{directory} has {_size(usage.free)} free of {_size(usage.total)}; {what}{there}",
                "if the engines run already, their regions are in the used space and "
                "all is well; otherwise free " + directory + " before they start (a "
                "region no running engine holds can be removed)",
            )
        ]
    return [
        Finding(
            "ok",
            directory,
            f"{directory} holds G2: {what}, {_size(usage.free)} free of {_size(usage.total)}",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sessionkv doctor", description=__doc__.split("\n")[0])
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        help="an engine's control endpoint, tcp://host:port (repeat)",
    )
    p.add_argument("--secret-file", help="the shared secret (router key), with --engine")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="an engine's --kv-transfer-config: check here that /dev/shm holds G2",
    )
    p.add_argument(
        "--local-engines",
        type=int,
        default=1,
        metavar="N",
        help="engines on this host, each with its own G2 (data-parallel ranks "
        "count one each; default 1)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per finding")
    args = p.parse_args(argv)
    if not args.engine and args.kv_transfer_config is None:
        p.error("give --engine (repeat) and --secret-file, or --kv-transfer-config")
    if args.engine and not args.secret_file:
        p.error("--engine needs --secret-file")
    if args.local_engines < 1:
        p.error("--local-engines must be at least 1")
    findings: list[Finding] = []
    if args.kv_transfer_config is not None:
        try:
            g2 = g2_bytes(args.kv_transfer_config)
        except ValueError as e:
            print(f"sessionkv doctor: {e}", file=sys.stderr)
            return 2
        findings += shm_findings(g2, args.local_engines)
    if args.engine:
        with open(args.secret_file, "rb") as fh:
            secret = fh.read().strip()
        answers, asked = ask(args.engine, secret, args.timeout)
        findings += asked + compare(answers)
    for f in findings:
        if args.json:
            print(json.dumps(asdict(f)))
        else:
            print(f"[{f.level}] {f.engine}: {f.what}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    return 1 if any(f.level == "error" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
