"""KV overlap: which worker already holds a prompt's prefix blocks, and where.

The router names a prompt's blocks the way the engines do: vLLM's chained
block hash ``hash((parent, tuple(block_tokens), extra_keys))`` with the
engine's hash function (``prefix_caching_hash_algo``) and its block-hash root
(vLLM's ``NONE_HASH``), computed here with ``hashlib`` and ``pickle``/``cbor2``
so the router runs without vLLM. ``BlockHasher.from_probe`` takes the
function, block size and root from an engine's ``probe`` answer and checks its
own hashes of the probe tokens against the engine's; an engine whose answer
does not match (another function, another root, extra keys the router does
not know) gets no overlap routing (``ProbeMismatch``): affinity and load only.

``OverlapIndex`` follows one engine's event stream:

- ``association`` ``extend`` names the deepest block (``frontier``) of a
  session's chain in ``tier``: G1 extends mark that key (and so its prefix)
  as held in G1. vLLM reports no G1 evictions, so G1 knowledge is bounded by
  recency (``g1_keys`` most recent frontiers) and goes stale as G1 fills;
- ``residency`` (G2, present or not), ``eviction`` (G2; no keys: the whole
  tier) and ``transfer`` into G2 (loads from G3) keep the G2 key set exact.

G3 is one store shared by every engine, so it prefers no worker and is not
scored. A prompt's score on a worker is the weighted number of blocks up to
the deepest prompt block held there (chunk keys name a chunk's last block; a
deeper key held implies its prefix was held when it was written).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sessionkv.events import Association, Eviction, Residency, Transfer

PROBE_TOKENS = [(i * 7919 + 13) % 30000 + 5 for i in range(200)]
GROUP0 = (0).to_bytes(4, "big")  # OffloadKey = block hash + KV cache group index
MAX_BLOCK_SIZE = 1 << 16


class ProbeMismatch(ValueError):
    """The engine hashes blocks differently from the router (or cannot say how)."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


@dataclass(frozen=True)
class BlockHasher:
    """vLLM's chained block hashes of full blocks (see the module docstring)."""

    block_size: int
    algo: str
    root: bytes

    def hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The block hashes of ``tokens``' full blocks (``cache_salt`` keys the first)."""
        fn = HASH_FUNCTIONS[self.algo]
        out, parent, bs = [], self.root, self.block_size
        for i in range(len(tokens) // bs):
            extra = (("cache_salt", cache_salt),) if cache_salt and i == 0 else None
            parent = fn((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
            out.append(parent)
        return out

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The blocks' keys as events name them (group 0)."""
        return [h + GROUP0 for h in self.hashes(tokens, cache_salt)]

    @classmethod
    def from_probe(cls, answer: dict[str, Any], tokens: Sequence[int]) -> BlockHasher:
        """A hasher that reproduces the engine's ``probe`` answer for ``tokens``;
        ``ProbeMismatch`` when none does."""
        try:
            algo, bs = answer["hash_algo"], answer["block_size"]
            root, want = bytes.fromhex(answer["hash_root"]), answer["block_hashes"]
        except (KeyError, TypeError, ValueError) as e:
            raise ProbeMismatch(f"probe answer incomplete: {e!r}") from None
        if isinstance(bs, bool) or not isinstance(bs, int) or not 0 < bs <= MAX_BLOCK_SIZE:
            raise ProbeMismatch(f"probe answer's block_size {bs!r} is not 1..{MAX_BLOCK_SIZE}")
        if not isinstance(want, list) or not all(isinstance(h, str) for h in want):
            raise ProbeMismatch("probe answer's block_hashes are not a list of hex strings")
        if not isinstance(algo, str) or algo not in HASH_FUNCTIONS:
            raise ProbeMismatch(
                f"hash function {algo!r} not reproduced by the router "
                f"(known: {', '.join(HASH_FUNCTIONS)})"
            )
        hasher = cls(bs, algo, root)
        got = [h.hex() for h in hasher.hashes(tokens)]
        if not want or got != list(want):
            raise ProbeMismatch(
                f"the router's {algo} block hashes differ from the engine's "
                f"({len(want)} blocks probed)"
            )
        return hasher


class OverlapIndex:
    """One engine's blocks in G1 (recent frontiers) and G2 (exact), from its
    events (see the module docstring). Single-threaded (the router's loop)."""

    def __init__(self, g1_keys: int = 65_536):
        self._g1: OrderedDict[bytes, None] = OrderedDict()
        self._g1_cap = g1_keys
        self.g2: set[bytes] = set()

    def clear(self) -> None:
        self._g1.clear()
        self.g2.clear()

    def apply(self, ev: Any) -> None:
        if isinstance(ev, Association):
            if ev.op == "extend" and ev.frontier is not None and ev.tier == "G1":
                self._g1[ev.frontier] = None
                self._g1.move_to_end(ev.frontier)
                while len(self._g1) > self._g1_cap:
                    self._g1.popitem(last=False)
        elif isinstance(ev, Residency) and ev.tier == "G2":
            (self.g2.update if ev.present else self.g2.difference_update)(ev.keys)
        elif isinstance(ev, Eviction) and ev.tier == "G2":
            if ev.keys:
                self.g2.difference_update(ev.keys)
            else:
                self.g2.clear()
        elif isinstance(ev, Transfer) and ev.dst == "G2" and ev.ok:
            self.g2.update(ev.keys)

    def held(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(blocks held in G1, in G2): the depth of the deepest key held in each."""
        g1 = g2 = 0
        for depth in range(len(keys), 0, -1):
            k = keys[depth - 1]
            if not g1 and k in self._g1:
                g1 = depth
            if not g2 and k in self.g2:
                g2 = depth
            if g1 and g2:
                break
        return g1, g2

    def __len__(self) -> int:
        return len(self._g1) + len(self.g2)


def score(held: tuple[int, int], g2_weight: float) -> float:
    """A worker's score for a prompt: its G1 blocks, plus the deeper G2 ones
    weighted (a G2 hit still copies to G1)."""
    g1, g2 = held
    return g1 + g2_weight * max(0, g2 - g1)
