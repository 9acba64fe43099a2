"""Trace replay simulator: real G2 policies, index and hint executor; simulated
time and data movement.

One ``Worker`` is one engine: G1 (vLLM's prefix cache, modelled as an LRU of
blocks that hands out its leading resident prefix), G2 (vLLM's real
``CPUOffloadingManager`` with a real ``CachePolicy``: vLLM's LRU or ARC, or our
``SessionCachePolicy``), and, for hinted policies, the real
``SessionPrefixIndex`` and ``HintExecutor``. Workers may share one G3 (an LRU
of blocks that every G2 store writes through to, as vLLM's tiering cascade does).

A request is served at its trace timestamp, in the order vLLM's offloading
connector calls the manager: G1 prefix hit (``a`` blocks), then G2/G3
``lookup`` from block ``a`` on until the first miss (``b`` blocks), then
``prepare_load``/``complete_load`` of the G2 hits, ``prepare_store``/
``complete_store`` of what the request computed (every block when nothing was
loaded, as vLLM's chunk-level offload does), ``on_request_finished``, and G1
takes the whole chain. Hits are ``a + b`` blocks: prefix semantics, a request
hits only its leading resident prefix. Nothing is timed and no byte is copied:
transfers are counted in tokens (bytes = tokens x KV bytes per token).

``run_opt`` is the offline reference: one cache with every tier's capacity
together, Belady per block (evict the resident block whose next use is
furthest away, deeper blocks first on ties), prefix semantics.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from replay_router import make_router
from replay_time import HINTS, TURN
from replay_trace import BLOCK_TOKENS, SimClock, Trace, key_of
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from sessionkv.config import Limits
from sessionkv.engine.executor import HintExecutor
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.tiers.g2.policy import SessionCachePolicy
from sessionkv.types import Tier

# G2 policy name -> (vLLM eviction_policy, cache_policy_module_path); built
# by vLLM's own CachePolicyFactory, as ``cls(cache_capacity=n)``.
G2_POLICIES = {
    "lru": ("lru", None),
    "arc": ("arc", None),
    "session": ("SessionCachePolicy", "sessionkv.tiers.g2.policy"),
    "naive": ("SessionCachePolicy", "sessionkv.tiers.g2.policy"),
    "naive-unbounded": ("SessionCachePolicy", "sessionkv.tiers.g2.policy"),
}
ALL_POLICIES = ("lru", "arc", "naive", "naive-unbounded", "session", "opt")
DEFAULT_KV_BYTES_PER_TOKEN = 131_072  # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 B


class G1Cache:
    """vLLM's GPU prefix cache as an LRU of blocks. A finished request's blocks
    are freed tail first (vLLM frees in reverse order), so its head is the most
    recently used and its tail goes first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def prefix(self, ids: list[int]) -> int:
        """How many leading blocks of ``ids`` are resident."""
        n = 0
        lru = self._lru
        for b in ids:
            if b not in lru:
                break
            n += 1
        return n

    def admit(self, ids: list[int]) -> list[int]:
        """The request's blocks are all in G1 now; returns the blocks evicted."""
        lru = self._lru
        for b in reversed(ids):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
        out = []
        while len(lru) > self.capacity:
            out.append(lru.popitem(last=False)[0])
        return out


class SharedG3:
    """Shared storage (Mooncake Store, Redis under LRU) as an LRU of blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._lru

    def touch(self, ids: list[int]) -> None:
        for b in reversed(ids):
            if b in self._lru:
                self._lru.move_to_end(b)

    def write(self, ids: list[int]) -> set[int]:
        """Write-through of blocks stored in some G2; the ones new here."""
        lru, new = self._lru, set()
        for b in reversed(ids):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
                new.add(b)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return new


@dataclass
class Served:
    """What serving one request did, in blocks (``*_tokens`` in tokens)."""

    hit_blocks: int
    hit_tokens: int
    g1_hits: int
    g2_hits: int
    g3_hits: int
    g2_load_tokens: int  # G2 -> G1
    g3_load_tokens: int  # G3 -> G2 (promotion) and on to G1
    g2_store_tokens: int  # G1 -> G2
    g3_store_tokens: int  # G2 -> G3 (write-through)
    store_failed: bool


class Worker:
    """One engine: G1 model, real G2 manager and policy, and for hinted
    policies the real SessionPrefixIndex and HintExecutor (see the module
    docstring)."""

    def __init__(
        self,
        policy: str,
        g1_blocks: int,
        g2_blocks: int,
        clock: SimClock,
        g3: SharedG3 | None = None,
        limits: Limits | None = None,
        hinted: bool = False,
    ):
        name, module = G2_POLICIES[policy]
        self.g1 = G1Cache(g1_blocks)
        self.g2_blocks = g2_blocks
        self.g3 = g3
        self.manager = CPUOffloadingManager(
            num_chunks=g2_blocks, cache_policy=name, cache_policy_module_path=module
        )
        self.policy = self.manager._policy  # vLLM keeps it private; read-only use
        if isinstance(self.policy, SessionCachePolicy):
            self.policy.clock = clock  # TTLs run on trace time
        self.index: SessionPrefixIndex | None = None
        self.executor: HintExecutor | None = None
        if hinted:
            self.index = SessionPrefixIndex(initial_capacity=4 * (g1_blocks + g2_blocks))
            self.executor = HintExecutor(
                self.index, limits or Limits(), self.policy, g2_chunks=g2_blocks, clock=clock
            )
        self._req = 0

    def serve(
        self, ids: list[int], keys: list[bytes], toks: list[int], session: str | None, now: float
    ) -> Served:
        """Serve one request (see the module docstring)."""
        mgr, g3, index = self.manager, self.g3, self.index
        self._req += 1
        ctx = ReqContext(req_id=str(self._req))
        mgr.on_new_request(ctx)
        for p, k in enumerate(keys):
            ctx.set_offload_key_position(k, (p + 1) * BLOCK_TOKENS)
        n = len(ids)
        a = self.g1.prefix(ids)
        # The connector looks up from the first block G1 did not have.
        from_g2: list[bytes] = []
        from_g3: list[int] = []
        p = a
        HIT = LookupResult.HIT
        while p < n:
            if mgr.lookup(keys[p], ctx) is HIT:
                from_g2.append(keys[p])
            elif g3 is not None and ids[p] in g3:
                from_g3.append(p)
            else:
                break
            p += 1
        b = p - a
        if from_g2:
            mgr.prepare_load(from_g2, ctx)
            mgr.complete_load(from_g2, ctx)
        # Chunk-level offload: after a load only what follows it is offered
        # (G3 promotions included, they land in G2); with nothing loaded, every
        # block is offered (G1 hits become G2 reuses or insertions).
        if b:
            offered = [keys[q] for q in from_g3] + keys[a + b :]
        else:
            offered = keys
        out = mgr.prepare_store(offered, ctx) if offered else None
        stored: list[bytes] = []
        evicted: list[bytes] = []
        failed = bool(offered) and out is None
        if out is not None:
            stored = list(out.keys_to_store)
            evicted = list(out.evicted_keys)
            mgr.complete_store(stored, ctx)
        mgr.on_request_finished(ctx)
        g1_out = self.g1.admit(ids)

        if index is not None:
            index.admit(session, keys, Tier.G1, 0, now)
            if evicted:
                index.set_copies(Tier.G2, evicted, 0)
            if stored:
                index.set_copies(Tier.G2, stored, 1)
            if g1_out:
                index.set_copies(Tier.G1, [key_of(x) for x in g1_out], 0)

        g3_load = sum(toks[q] for q in from_g3)
        promoted = {keys[q] for q in from_g3}
        g2_store = g3_store = 0
        if stored:
            tok_of = dict(zip(keys, toks))
            g2_store = sum(tok_of[k] for k in stored if k not in promoted)
        if g3 is not None:
            if from_g3:
                g3.touch([ids[q] for q in from_g3])
            if stored:
                id_of = dict(zip(keys, zip(ids, toks)))
                new = g3.write([id_of[k][0] for k in stored])
                g3_store = sum(id_of[k][1] for k in stored if id_of[k][0] in new)
        return Served(
            hit_blocks=a + b,
            hit_tokens=sum(toks[: a + b]),
            g1_hits=a,
            g2_hits=len(from_g2),
            g3_hits=len(from_g3),
            g2_load_tokens=sum(toks[a : a + b]) - g3_load,
            g3_load_tokens=g3_load,
            g2_store_tokens=g2_store,
            g3_store_tokens=g3_store,
            store_failed=failed,
        )


# ------------------------------------------------------------------ runs


@dataclass
class RunSpec:
    """One simulated configuration."""

    policy: str
    g2_blocks: int
    g1_blocks: int | None = None  # default: a quarter of G2
    workers: int = 1
    routing: str = "sticky"  # or "random"
    shared_g3_blocks: int = 0
    seed: int = 0
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN

    @property
    def g1(self) -> int:
        return self.g2_blocks // 4 if self.g1_blocks is None else self.g1_blocks

    @property
    def total_capacity(self) -> int:
        """Blocks over every tier: what the offline reference gets."""
        return self.workers * (self.g1 + self.g2_blocks) + self.shared_g3_blocks


@dataclass
class Tally:
    """Counters of one run."""

    hit_tokens: int = 0
    hit_blocks: int = 0
    tokens: int = 0
    blocks: int = 0
    g1_hits: int = 0
    g2_hits: int = 0
    g3_hits: int = 0
    g2_to_g1: int = 0
    g1_to_g2: int = 0
    g3_to_g2: int = 0
    g2_to_g3: int = 0
    store_failures: int = 0
    hints: Counter = field(default_factory=Counter)
    per_request: list = field(default_factory=list)  # hit tokens of each request
    g1_tokens: list = field(default_factory=list)  # of them, tokens G1 had
    events: list = field(default_factory=list)  # for replay_time (its docstring)

    def add(self, s: Served, tokens: int, blocks: int) -> None:
        self.per_request.append(s.hit_tokens)
        self.g1_tokens.append(s.hit_tokens - s.g2_load_tokens - s.g3_load_tokens)
        self.hit_tokens += s.hit_tokens
        self.hit_blocks += s.hit_blocks
        self.tokens += tokens
        self.blocks += blocks
        self.g1_hits += s.g1_hits
        self.g2_hits += s.g2_hits
        self.g3_hits += s.g3_hits
        self.g2_to_g1 += s.g2_load_tokens + s.g3_load_tokens
        self.g3_to_g2 += s.g3_load_tokens
        self.g1_to_g2 += s.g2_store_tokens
        self.g2_to_g3 += s.g3_store_tokens
        self.store_failures += s.store_failed


def result(spec: RunSpec, tally: Tally, wall_s: float) -> dict:
    """One row of the JSON ``runs`` list (``ratio_to_opt`` is filled in later)."""
    bpt = spec.kv_bytes_per_token
    row = asdict(spec)
    row.pop("seed")
    row.pop("kv_bytes_per_token")
    row["g1_blocks"] = spec.g1 if spec.policy != "opt" else 0
    row.update(
        total_capacity_blocks=spec.total_capacity,
        token_hit_ratio=tally.hit_tokens / max(1, tally.tokens),
        block_hit_ratio=tally.hit_blocks / max(1, tally.blocks),
        ratio_to_opt=None,
        prompt_tokens=tally.tokens,
        recomputed_prefill_tokens=tally.tokens - tally.hit_tokens,
        hits_by_tier={"g1": tally.g1_hits, "g2": tally.g2_hits, "g3": tally.g3_hits},
        bytes_moved={
            "g2_to_g1": tally.g2_to_g1 * bpt,
            "g1_to_g2": tally.g1_to_g2 * bpt,
            "g3_to_g2": tally.g3_to_g2 * bpt,
            "g2_to_g3": tally.g2_to_g3 * bpt,
        },
        store_failures=tally.store_failures,
        hints=dict(sorted(tally.hints.items())),
        wall_s=round(wall_s, 3),
    )
    # for gap_breakdown and the time model; not written to JSON
    row["_per_request"] = tally.per_request
    row["_g1_tokens"] = tally.g1_tokens
    row["_events"] = tally.events
    return row


def gap_breakdown(trace: Trace, run: dict, opt: dict) -> dict:
    """Where ``run`` loses prompt tokens that ``opt`` hits, as fractions of the
    trace's prompt tokens: first turns (only shared prefixes of other sessions
    can hit) and continuation turns by the gap since the session's previous
    turn. Requests where ``run`` hits more than ``opt`` count negative."""
    last: dict[int, float] = {}
    out: Counter = Counter()
    total = max(1, trace.total_tokens)
    for i, (ours, ref) in enumerate(zip(run["_per_request"], opt["_per_request"])):
        s = trace.session[i]
        if s in last:
            gap = trace.t[i] - last[s]
            kind = (
                "continuation, gap < 60 s"
                if gap < 60
                else "continuation, gap 60-180 s"
                if gap < 180
                else "continuation, gap 180-600 s"
                if gap < 600
                else "continuation, gap >= 600 s"
            )
        else:
            kind = "first turn (shared prefixes)"
        last[s] = trace.t[i]
        out[kind] += (ref - ours) / total
    return dict(sorted(out.items()))


_KEYS: list = [None, None]  # [the trace, its keys]: the trace is held, so never a stale id


def trace_keys(trace: Trace) -> list[list[bytes]]:
    """Every request's OffloadKeys, built once per trace and shared by all runs."""
    if _KEYS[0] is not trace:
        cache: dict[int, bytes] = {}
        _KEYS[1] = [
            [cache[b] if b in cache else cache.setdefault(b, key_of(b)) for b in ids]
            for ids in trace.blocks
        ]
        _KEYS[0] = trace
    return _KEYS[1]


Progress = Callable[[int], None]


def run_policy(trace: Trace, spec: RunSpec, progress: Progress | None = None) -> dict:
    """Replay ``trace`` through ``spec.workers`` engines with the named G2
    policy (``lru``, ``arc``, ``session``, ``naive``); the hint policy of
    ``session`` and ``naive`` is in ``replay_router``."""
    if spec.policy == "opt":
        return run_opt(trace, spec, progress)
    t0 = time.perf_counter()
    clock = SimClock()
    g3 = SharedG3(spec.shared_g3_blocks) if spec.shared_g3_blocks else None
    router_cls, limits = make_router(spec.policy)
    workers = [
        Worker(
            spec.policy, spec.g1, spec.g2_blocks, clock, g3, limits, hinted=router_cls is not None
        )
        for _ in range(spec.workers)
    ]
    router = router_cls(trace, workers, clock) if router_cls is not None else None
    rng = random.Random(spec.seed)
    keys = trace_keys(trace)
    tally = Tally()
    W = spec.workers
    sticky = spec.routing == "sticky"
    if spec.routing not in ("sticky", "random"):
        raise ValueError(f"routing must be sticky or random, not {spec.routing!r}")
    events = tally.events

    def hint_events() -> None:
        events.extend((HINTS, t, wk, n) for t, wk, n in router.work_log)
        router.work_log.clear()

    for i, ids in enumerate(trace.blocks):
        now = clock.now = trace.t[i]
        s = trace.session[i]
        w = (s % W if sticky else rng.randrange(W)) if W > 1 else 0
        if router is not None:
            router.before(i, now)
        toks = trace.tokens[i]
        if router is not None:
            router.start(i, w, now, keys[i])
            hint_events()
        served = workers[w].serve(ids, keys[i], toks, f"s{s}", now)
        tally.add(served, trace.input_length[i], len(ids))
        events.append(
            (
                TURN,
                now,
                w,
                i,
                tally.g1_tokens[-1],
                served.g2_load_tokens,
                served.g3_load_tokens,
                trace.input_length[i] - served.hit_tokens,
            )
        )
        if router is not None:
            router.after(i, w, now)
            hint_events()
        if progress is not None and (i & 255) == 0:
            progress(i)
    if router is not None:
        tally.hints.update(router.outcomes)
    row = result(spec, tally, time.perf_counter() - t0)
    if router is not None:
        n = router.work_n
        row["hint_work"] = {
            "hints": n,
            "wall_s": round(router.work_s, 3),
            "wall_s_per_hint": router.work_s / n if n else 0.0,
        }
    if router is not None and hasattr(router, "policy"):
        row["router"] = router.policy.status()
    return row


def run_opt(trace: Trace, spec: RunSpec, progress: Progress | None = None) -> dict:
    """The offline reference (see the module docstring) with every tier's
    capacity in one cache."""
    t0 = time.perf_counter()
    cap = spec.total_capacity
    resident: dict[int, int] = {}  # block -> its next use (request index)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazily invalidated
    tally = Tally()
    push, pop = heapq.heappush, heapq.heappop
    for i, ids in enumerate(trace.blocks):
        toks = trace.tokens[i]
        a = 0
        for b in ids:
            if b not in resident:
                break
            a += 1
        tally.hit_blocks += a
        tally.hit_tokens += sum(toks[:a])
        tally.per_request.append(sum(toks[:a]))
        tally.tokens += trace.input_length[i]
        tally.blocks += len(ids)
        for depth, (b, nu) in enumerate(zip(ids, trace.next_use[i])):
            resident[b] = nu
            push(heap, (-nu, -depth, b))
        # Evict furthest next use first; never-used-again blocks (NEVER) go
        # before anything, the request's own included (Belady bypass).
        while len(resident) > cap:
            negnu, _, b = pop(heap)
            if resident.get(b) == -negnu:
                del resident[b]
        if len(heap) > 4 * cap + 1024:  # drop invalidated entries
            heap = _compact(heap, resident)
        if progress is not None and (i & 255) == 0:
            progress(i)
    spec_row = result(spec, tally, time.perf_counter() - t0)
    spec_row["g1_blocks"] = 0
    return spec_row


def _compact(heap: list, resident: dict[int, int]) -> list:
    live = [e for e in heap if resident.get(e[2]) == -e[0]]
    heapq.heapify(live)
    return live
