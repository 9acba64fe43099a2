"""The fingerprint in every G3 object key: which engines' bytes are interchangeable.

A G3 key is ``namespace / fingerprint / OffloadKey hex``. Two engines share a
chunk only when they agree on everything that shapes its bytes (ARCHITECTURE.md,
"Never wrong KV"), each an explicit field (``identity_fields``):

- the model's weights and config by content (``weights_digest``), so a hub
  id at another revision, or a repository after a push, is another model;
- quantization, the KV cache dtype, whether its scales are computed at run
  time or read from the checkpoint (fp8 KV stores other bytes either way),
  the layers it skips, and ``hf_overrides`` (rope scaling and the like
  change K);
- the block size, blocks per chunk, the KV layout, the parallel sizes, and
  the block hash function and its seed (``NONE_HASH`` is the hash function
  applied to the seed, so it stands for both); the chunk size in bytes
  guards whatever else changes it.

Settings that do not touch K/V (ports, ``max_num_seqs``, ``max_model_len``)
are not fields: engines that differ only there share. vLLM's own
``ModelConfig.compute_hash`` is not used: it ignores ``hf_overrides`` and
includes ``max_model_len``.

The weights digest covers every byte: config files whole, and each weight
file by its content hash. In a Hugging Face cache a weight file is a link to
a blob named by its SHA-256 (Git LFS), which is read, not recomputed; any
other file is hashed once with BLAKE3 (multi-threaded: 4.6 GiB/s in memory
on this machine's 2 cores, BLAKE2b 0.7; so a 140 GB checkpoint costs about
30 s plus reading it, once) and the result cached outside the model folder
(often read-only) by path, size and modification time. A model given by hub id is found in the local Hugging
Face cache (``refs/<revision>`` -> snapshot); nothing here reaches a hub.
A model found nowhere cannot be fingerprinted: G3 is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "quantization_config.json",
    "quant_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DIGEST_CACHE = Path.home() / ".cache" / "sessionkv" / "weight-digests.json"
CACHE_ENTRIES = 4096  # weight files remembered, newest kept
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")
IDENTITY_VERSION = 2


class FingerprintError(ValueError):
    """The engine's KV identity cannot be established: G3 would be unsafe."""


def _file_digest(p: Path, cache: dict[str, str]) -> str:
    real = p.resolve()
    if real.parent.name == "blobs" and _LFS_BLOB.fullmatch(real.name):
        return "sha256:" + real.name  # the hub named it by its content
    st = real.stat()
    tag = f"{real}\0{st.st_size}\0{st.st_mtime_ns}"
    hit = cache.get(tag)
    if hit is not None:
        return hit
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(real, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    out = cache[tag] = "blake3:" + h.hexdigest()
    return out


def _load_cache(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(doc, dict)
        else {}
    )


def _save_cache(path: Path | None, cache: dict[str, str]) -> None:
    if path is None:
        return
    keep = dict(list(cache.items())[-CACHE_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(keep))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only: the next start hashes again


def hub_snapshot(model: str, revision: str | None, hub_cache: str | None = None) -> Path:
    """The local Hugging Face cache's snapshot of ``model`` at ``revision``
    (a branch, tag or commit; default ``main``), resolved through ``refs/``;
    never downloads. ``hub_cache``: the cache folder (default: the hub
    client's, ``HF_HUB_CACHE``)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(model, revision=revision, local_files_only=True, cache_dir=hub_cache)
        )
    except Exception as e:  # the hub client raises several types for "not cached"
        raise FingerprintError(
            f"cannot fingerprint model {model!r} at revision {revision or 'main'}: it is not a "
            f"local directory and not in the local Hugging Face cache ({type(e).__name__}); "
            "G3 needs to know which weights made the KV"
        ) from e


def weights_digest(
    model: str,
    revision: str | None = None,
    cache_path: Path | None = DIGEST_CACHE,
    hub_cache: str | None = None,
) -> str:
    """Hex digest of a model's config and weights by content (see the module
    docstring): ``model`` a local directory, or a hub id in the local cache."""
    root = Path(model)
    if not root.is_dir():
        root = hub_snapshot(model, revision, hub_cache)
    h = hashlib.blake2b(digest_size=16)
    for name in CONFIG_FILES:
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    weights = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not weights:
        raise FingerprintError(f"no weight files under {str(root)!r}: cannot fingerprint the model")
    cache = _load_cache(cache_path)
    before = dict(cache)
    for p in weights:
        h.update(f"{p.relative_to(root)}\0{_file_digest(p, cache)}\0".encode())
    if cache != before:
        _save_cache(cache_path, cache)
    return h.hexdigest()


def fingerprint(fields: Mapping[str, Any]) -> str:
    """32 hex characters over the identity fields (canonical JSON; bytes as hex)."""
    doc = json.dumps(plain(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


def plain(v: Any) -> Any:
    """``v`` as JSON values (bytes as hex, mappings with string keys)."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def identity_fields(
    *,
    weights: str,
    dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    kv_scales: str,
    kv_skip_layers: list[str],
    hf_overrides: Mapping[str, Any],
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
    return {
        "v": IDENTITY_VERSION,
        "weights": weights,
        "dtype": dtype,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_scales": kv_scales,
        "kv_skip_layers": sorted(kv_skip_layers),
        "hf_overrides": plain(dict(hf_overrides)),
        "block_size": block_size,
        "blocks_per_chunk": blocks_per_chunk,
        "layout": layout,
        "parallel": {"tp": tp, "pp": pp, "pcp": pcp, "dcp": dcp},
        "none_hash": none_hash,
        "chunk_bytes": chunk_bytes,
    }
