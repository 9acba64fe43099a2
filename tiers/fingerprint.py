"""The fingerprint in every G3 object key: which engines' bytes are interchangeable.

A G3 key is ``namespace / fingerprint / OffloadKey hex``. Two engines share a
chunk only when they agree on everything that shapes its bytes (ARCHITECTURE.md,
"Never wrong KV"): the model (a digest of its weights and config, not its path),
the KV dtype, the block size, blocks per chunk, the KV layout, the parallel
sizes, and the block hash function and its seed (``NONE_HASH`` is the hash
function applied to the seed, so it stands for both). Anything else is a miss.

The weights digest reads the model's config files whole and samples each
weight file (its size, and BLAKE2b over 4 MiB at its start, middle and end):
reading a 140 GB checkpoint at every start is not an option, and any two
checkpoints that differ only outside the samples would have to share size,
config and those 12 MiB. A model that is not a local directory is named by
its id (and revision) instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 4 << 20
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_digest(model: str, revision: str | None = None) -> str:
    """Hex digest standing for a model's weights and config (see module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(model)
    if not root.is_dir():
        h.update(f"id:{model}@{revision or 'default'}".encode())
        return h.hexdigest()
    for name in CONFIG_FILES:
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    weights = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not weights:
        raise ValueError(f"no weight files under {model!r}: cannot fingerprint the model")
    for p in weights:
        size = p.stat().st_size
        h.update(f"{p.relative_to(root)}\0{size}\0".encode())
        with open(p, "rb") as f:
            for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2),
                              max(0, size - SAMPLE_BYTES)}):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(fields: Mapping[str, Any]) -> str:
    """32 hex characters over the identity fields (canonical JSON; bytes as hex)."""
    def plain(v: Any) -> Any:
        if isinstance(v, bytes):
            return v.hex()
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    doc = json.dumps(plain(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


def identity_fields(
    *,
    weights: str,
    dtype: str,
    block_size: int,
    blocks_per_chunk: int,
    layout: str,
    tp: int,
    pp: int,
    pcp: int,
    dcp: int,
    none_hash: bytes,
    chunk_bytes: int,
) -> dict[str, Any]:
    """The fields ``fingerprint`` covers, by name (see the module docstring).
    ``chunk_bytes`` guards against anything else that changes a chunk's size."""
    return {"v": 1, "weights": weights, "dtype": dtype, "block_size": block_size,
            "blocks_per_chunk": blocks_per_chunk, "layout": layout,
            "parallel": {"tp": tp, "pp": pp, "pcp": pcp, "dcp": dcp},
            "none_hash": none_hash, "chunk_bytes": chunk_bytes}
