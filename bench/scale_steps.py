"""Scheduler steps at production sizes: the connector's work per step, ours
against vLLM's ``OffloadingConnector`` on the same schedule.

A real vLLM ``Scheduler`` (CPU build, no model: outputs are made here, one
token per running request per step) drives a connector built the way
``vllm serve`` builds it from ``--kv-transfer-config``: ours
(``SessionTierConnector``, G2 = ``SessionCachePolicy``) or vLLM's own
``OffloadingConnector`` with its CPU spec and LRU policy (the baseline). The
worker side is simulated only as far as the scheduler sees it: every load and
store job a step's metadata carries is reported complete in the next step's
output (``OffloadingWorkerMetadata``), which is what vLLM's worker reports
when a copy ends; no bytes move.

Timed: every scheduler-side connector call (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished*``, and the two that vLLM's
scheduler makes at the end of every step, ``get_kv_connector_stats`` and
``take_events``: untimed until 2026-12-06, they were 0.06 and 0.01 ms of
our decode step at 256 x 64k against 0.03 and 0.00 of vLLM's), summed per
step by a subclass that wraps each in ``perf_counter``. Our extra work per step is
ours minus the baseline at the same step of the same schedule (the
schedules are identical: both connectors load nothing the other would not,
since G2 starts empty and every prompt, the warm requests' too, is new). Both schedulers live in one
process and step in turn (``run_both``): run one after the other, the same
code measured 0.03 and 5 ms apart per decode step at 256 x 64k.

Each step also reports the time spent in vLLM's *shared* scheduler-side code:
``OffloadingConnector``'s own methods, which both connectors run on the same
requests (ours through ``super()``), less the calls they make into the
offloading manager (ours: ``SessionTierManager``; vLLM's: its CPU manager
and LRU), where the two differ. A step's *work* is its time less that shared
part: for vLLM's connector its manager's time, for ours everything our code
adds plus our manager's time. The shared part is the same code on the same
inputs in both, so the difference of works is the difference of totals
without the shared part's noise: at 256 x 64k that part is about 7 ms a
decode step (vLLM's ``update_offload_keys`` walks every request's whole
``block_hashes`` with ``islice``), and the same connector on both sides
(A/A) differed by 1.2-2.9 ms at p99 over totals (2026-12-06).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from sessionkv.connectors.vllm import SessionTierConnector
from sessionkv.devtools.engines import TINY

BLOCK = 16
# A chunk here: one block of one layer, one head of size 1, float32 (128
# bytes), which vLLM's CPU spec rounds up to its alignment; the scheduler
# side sizes G2 from it and never touches the bytes.
CHUNK_BYTES = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
TIMED = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "get_kv_connector_stats",
    "take_events",
)


class _Timer:
    """Seconds since the last ``take``: in the timed connector calls
    (``spent``), and in vLLM's shared code inside them (``shared``, see the
    module docstring)."""

    spent = 0.0
    shared = 0.0
    in_shared = 0  # depth of OffloadingConnector's own timed methods

    @classmethod
    def take(cls) -> tuple[float, float]:
        out = (cls.spent, cls.shared)
        cls.spent = cls.shared = 0.0
        return out


def _timed(cls):
    """A subclass of connector ``cls`` whose scheduler-side calls add their
    wall time to ``_Timer`` (nested calls counted once)."""
    depth = [0]

    def wrap(name):
        base = getattr(cls, name)
        # vLLM's ``take_events`` is a generator, which the scheduler drains
        # after the call: drained here, so both sides count the draining.
        out = list if name == "take_events" else (lambda got: got)

        def call(self, *args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return out(base(self, *args, **kwargs))
            finally:
                depth[0] -= 1
                if not depth[0]:
                    _Timer.spent += time.perf_counter() - t0

        call.__name__ = name
        return call

    return type(f"Timed{cls.__name__}", (cls,), {n: wrap(n) for n in TIMED if hasattr(cls, n)})


def _shared(base):
    """``OffloadingConnector``'s own ``base`` method, adding its time to
    ``_Timer.shared`` (the manager calls inside are taken back out)."""

    def call(self, *args, **kwargs):
        _Timer.in_shared += 1
        t0 = time.perf_counter()
        try:
            return base(self, *args, **kwargs)
        finally:
            _Timer.in_shared -= 1
            if not _Timer.in_shared:
                _Timer.shared += time.perf_counter() - t0

    call.__name__ = base.__name__
    return call


# vLLM's connector with its own timed methods measured as shared code: both
# timed connectors derive from it, so ours reaches it by ``super()``.
_SharedOffloadingConnector = type(
    "SharedOffloadingConnector",
    (OffloadingConnector,),
    {n: _shared(getattr(OffloadingConnector, n)) for n in TIMED if hasattr(OffloadingConnector, n)},
)


class _SessionTierConnector(SessionTierConnector, _SharedOffloadingConnector):
    """Ours over the measured base (``super()`` from ours goes to
    ``_SharedOffloadingConnector`` first, then vLLM's)."""


def _watch_manager(manager) -> None:
    """The offloading manager's calls made from the shared code: their time
    is the connector's own work, so it leaves ``_Timer.shared``."""
    for name in (
        "lookup",
        "on_new_request",
        "get_load_source",
        "prepare_load",
        "prepare_store",
        "on_schedule_end",
        "on_request_finished",
        "complete_store",
        "complete_load",
        "get_stats",
        "take_events",
        "touch",
        "has_pending_work",
    ):
        base = getattr(manager, name, None)
        if base is None:
            continue

        def call(*args, _base=base, **kwargs):
            if not _Timer.in_shared:
                return _base(*args, **kwargs)
            held, _Timer.in_shared = _Timer.in_shared, 0  # nested: not shared
            t0 = time.perf_counter()
            try:
                return _base(*args, **kwargs)
            finally:
                _Timer.shared -= time.perf_counter() - t0
                _Timer.in_shared = held

        setattr(manager, name, call)


TimedSessionTierConnector = _timed(_SessionTierConnector)
TimedOffloadingConnector = _timed(_SharedOffloadingConnector)


@dataclass(frozen=True)
class StepSpec:
    """One schedule: ``warm_requests`` requests of ``context`` prompt tokens
    that generate one token each (earlier traffic, which leaves G2 full;
    untimed), then ``running`` requests of ``context`` prompt tokens (less
    0..15), prefilled ``batch_tokens`` at a time, then ``decode_steps``
    decoding."""

    context: int
    running: int = 256
    decode_steps: int = 64
    g2_chunks: int = 262_144
    batch_tokens: int = 65_536
    warm_requests: int = 0

    @property
    def max_len(self) -> int:
        """Tokens a request reaches: the first ones prefilled decode while the
        rest prefill."""
        prefill_steps = -(-self.running * self.context // self.batch_tokens)
        return self.context + 2 * (prefill_steps + self.decode_steps) + BLOCK


def make_scheduler(
    ours: bool,
    spec: StepSpec,
    policy_file: str | None = None,
    *,
    connector: tuple[str, str] | None = None,
    extra_config: dict | None = None,
) -> Scheduler:
    """vLLM's scheduler with our connector (``ours``) or vLLM's, timed;
    ``connector`` names another (class, module), ``extra_config`` adds to
    its ``kv_connector_extra_config`` (G3 tiers, say; a key given as None
    drops the default)."""
    blocks = spec.running * (spec.max_len // BLOCK + 1) + 64
    # Both offload generated tokens (agentic turns reuse them; the default is prompt only).
    extra = {
        "cpu_bytes_to_use": spec.g2_chunks * CHUNK_BYTES,
        "block_size": BLOCK,
        "offload_prompt_only": False,
        **(extra_config or {}),
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    if ours and policy_file is not None:
        extra["sessionkv"] = {"policy_file": policy_file}
    name, module = connector or (
        "TimedSessionTierConnector" if ours else "TimedOffloadingConnector",
        __name__ if __name__ != "__main__" else "scale_steps",
    )
    kvt = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        engine_id="scale",
        kv_connector_extra_config=extra,
    )
    config = VllmConfig(
        # No model runs: the tiny model's config only sizes the schedule, its
        # 8,192 positions raised to the contexts scheduled here.
        model_config=ModelConfig(
            model=TINY,
            dtype="float32",
            seed=0,
            max_model_len=spec.max_len,
            hf_overrides={"max_position_embeddings": spec.max_len},
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.running,
            max_num_batched_tokens=spec.batch_tokens,
            max_model_len=spec.max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True
        ),
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def session_request(
    rid: str, tokens: list[int], session: str, max_tokens: int, hasher=None
) -> Request:
    """A greedy request of ``session`` (``kv_transfer_params``), generating
    ``max_tokens`` tokens past EOS, its blocks hashed as the engine does."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, 0)
    req = Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=hasher or get_request_block_hasher(BLOCK, sha256),
    )
    req.kv_transfer_params = {"session_id": session}
    return req


def make_requests(
    spec: StepSpec, seed: int = 0, n: int | None = None, max_tokens: int = 1 << 20
) -> list[Request]:
    """``n`` requests (``spec.running``). Seed 0's and seed 1's sets differ
    in prompts, request and session ids, whatever seed 1's ``n`` (its
    prompts start after seed 0's ``spec.running``): the warm requests are
    seed 1's."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    rng = random.Random(seed)
    out = []
    n = spec.running if n is None else n
    for i in range(n):
        base = (seed * spec.running + i) * spec.context
        # Prompts of different lengths, as traffic has, so that decode steps
        # fill blocks of different requests at different steps. Drawn, not
        # ``i % BLOCK``: at 64k request i starts decoding about i steps into
        # the schedule (chunked prefill does one a step), which paired that
        # offset with the start into 8 phases, 32 blocks every other step
        # and none between, against 16 every step at 4k (16 prefill a step).
        length = spec.context - rng.randrange(BLOCK)
        tokens = [(base + t) % 50_000 + 1 for t in range(length)]
        out.append(session_request(f"r{seed}-{i}", tokens, f"s{seed}-{i}", max_tokens, hasher))
    return out


def model_output(sched_out, done_jobs: set[int]) -> ModelRunnerOutput:
    """What the workers would report for ``sched_out``: one token per request,
    ``done_jobs`` complete."""
    ids = list(sched_out.num_scheduled_tokens)
    meta = OffloadingWorkerMetadata()
    for j in done_jobs:
        meta.mark_completed(j)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=meta),
    )


def step(sched, done_jobs: set[int]) -> set[int]:
    """One engine step with the workers reporting ``done_jobs`` complete; the
    jobs this step started, which the next step reports (as vLLM's worker
    does). A step with nothing scheduled waits a little: lookups and G3
    copies run on threads."""
    out = sched.schedule()
    if not out.num_scheduled_tokens:
        time.sleep(0.01)
    meta = out.kv_connector_metadata
    sched.update_from_output(out, model_output(out, done_jobs))
    return set(getattr(meta, "load_jobs", ())) | set(getattr(meta, "store_jobs", ()))


def step_times(
    ours: bool, spec: StepSpec, policy_file: str | None = None
) -> Iterator[tuple[str, tuple[float, float]]]:
    """Prefill ``spec``'s requests, decode them ``decode_steps`` steps once
    all are decoding, then finish them all, one step per ``next``: yields
    (phase, (the connector's seconds in that step, its work: those less
    vLLM's shared code)). Two of these stepped in turn (``run_both``) see
    the same machine noise and memory state."""
    sched = make_scheduler(ours, spec, policy_file)
    _watch_manager(sched.connector.connector_scheduler.manager)
    for r in make_requests(spec, seed=1, n=spec.warm_requests, max_tokens=1):
        sched.add_request(r)
    _Timer.take()
    pending: set[int] = set()

    def step() -> bool:
        nonlocal pending
        out = sched.schedule()
        meta = out.kv_connector_metadata
        sched.update_from_output(out, model_output(out, pending))
        pending = set()
        if isinstance(meta, OffloadingConnectorMetadata):
            pending = set(meta.load_jobs) | set(meta.store_jobs)
        return bool(out.num_scheduled_tokens) and all(
            n == 1 for n in out.num_scheduled_tokens.values()
        )

    def took() -> tuple[float, float]:
        spent, shared = _Timer.take()
        return spent, spent - shared

    try:
        while sched.has_requests() or pending:
            step()
            yield "warm", took()
        reqs = make_requests(spec)
        for r in reqs:
            sched.add_request(r)
        gc.collect()
        _Timer.take()
        while not step():
            yield "prefill", took()
        # The first step that schedules only decodes still completes the last
        # prefill chunks' stores (their job ids come back in its output): prefill.
        yield "prefill", took()
        for _ in range(spec.decode_steps):
            step()
            yield "decode", took()
        sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_LENGTH_CAPPED)
        yield "finish", took()
        while sched.has_requests() or pending:
            step()
            yield "finish", took()
    finally:
        sched.shutdown()


def run_both(spec: StepSpec, repeats: int = 1, same: bool = False) -> tuple[dict, dict]:
    """vLLM's connector and ours on the same schedule, a step of each in
    turn: (vLLM's, ours), each phase -> {"total": seconds per step, "work":
    the same less vLLM's shared code (module docstring)}. With ``repeats``,
    the schedule runs that many times and each step keeps its fastest run,
    for each connector alone: the schedule is deterministic, so step i does
    the same work every time, and what a repeat adds is the machine's noise
    (a 10 ms step at 256 x 64k varies by about 0.5 ms from step to step).
    ``same``: vLLM's connector on both sides (A/A), whose difference is the
    measurement's noise floor."""
    passes = [_run_both_once(spec, ours_first=bool(i % 2), same=same) for i in range(repeats)]
    out = []
    for side in (0, 1):
        per_phase = {}
        for phase in passes[0][side]:
            runs = [p[side][phase] for p in passes]
            if len({len(r) for r in runs}) != 1:
                raise RuntimeError(f"{phase}: the repeats' schedules differ")
            per_phase[phase] = {
                m: [min(t[i] for t in ts) for ts in zip(*runs)]
                for i, m in enumerate(("total", "work"))
            }
        out.append(per_phase)
    return out[0], out[1]


def _run_both_once(
    spec: StepSpec, ours_first: bool = False, same: bool = False
) -> tuple[dict, dict]:
    """One run of the schedule, a step of each connector in turn: (vLLM's,
    ours). ``run_both`` alternates which steps first, since the second of a
    pair meets the caches the first left."""
    sides = (True, False) if ours_first else (False, True)
    runs = [step_times(ours and not same, spec) for ours in sides]
    out: list[dict[str, list[tuple[float, float]]]] = [
        {"warm": [], "prefill": [], "decode": [], "finish": []} for _ in runs
    ]
    for (pa, a), (pb, b) in zip(*runs, strict=True):
        if pa != pb:
            raise RuntimeError(f"the schedules differ: {pa} vs {pb}")
        out[0][pa].append(a)
        out[1][pb].append(b)
    return (out[1], out[0]) if ours_first else (out[0], out[1])
