"""``SessionTierConnector``: the vLLM KV connector users name in ``--kv-transfer-config``.

    --kv-transfer-config '{"kv_connector": "SessionTierConnector",
        "kv_connector_module_path": "sessionkv.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1073741824,
                                      "sessionkv": {"policy_file": "tiers.yaml"}}}'

It is vLLM's ``OffloadingConnector`` over ``SessionTierSpec`` (G2 = the CPU
primary tier, G3 = secondary tiers), plus:

- each request's session (``Request.session_id``, else
  ``kv_transfer_params["session_id"]``) and hints, read once when it arrives
  and kept with everything else the connector follows of it (``_Tracked``);
  the hints act when it finishes (``SessionTierManager.execute_request_hints``),
  on the whole turn: the blocks its last tokens filled join the index then,
  and the chunks vLLM stores after it finished get the hints when they arrive
  (``engine/executor.py``, ``Turn``);
- a per-request report (``sessionkv.report.RequestReport``) returned from
  ``request_finished`` into the response's ``kv_transfer_params``;
- configurations it cannot serve correctly refused at start;
- the control channel and event stream (``engine.control``), in the
  scheduler process only, when the policy names a secret.

Threading: every scheduler-side method runs on vLLM's scheduler thread and
holds the tier manager's lock: from the first call of a ``schedule()`` pass
(``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
``build_connector_meta``) until ``build_connector_meta`` returns, which vLLM
calls exactly once per pass; the other calls (``on_new_request``,
``request_finished``, ``update_connector_output``) hold it for their own
duration. Other threads take the same lock and change only metadata. Who
takes it differs by release (``tiers/compat.py``): on 0.32 this
connector (``_enter_pass``, ``_around_vllm``); on 0.33 vLLM's connector
scheduler in its own hooks, and this connector only around its own work
outside them (``_locked``, ``compat.after_vllm_step``).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sessionkv.connectors.fills import FillWatch
from sessionkv.connectors.kv_events import SessionEventsTracker
from sessionkv.connectors.manager import SessionTierManager
from sessionkv.connectors.probe import make_probe
from sessionkv.connectors.spec import has_device_worker
from sessionkv.connectors.startup import (
    bind_spec,
    check_supported,
    g1_probe,
    model_identity,
    start_control,
)
from sessionkv.engine.control import ControlChannel
from sessionkv.engine.requests import read_request
from sessionkv.engine.waits import Turn
from sessionkv.events import Association, Op
from sessionkv.hints import HintOutcome, KvHint, Status, is_id
from sessionkv.index.prefix_index import SessionPrefixIndex
from sessionkv.report import RequestReport
from sessionkv.tiers import compat
from sessionkv.tiers.g3.spec import IDENTITY_KEY
from sessionkv.types import Tier, TierName

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
SESSION_PARAM = "session_id"
# Sessions a router-signed request named, least recent out past this: an
# unsigned request naming one runs without a session (it cannot join it).
MAX_SIGNED_SESSIONS = 65_536
SIG_WARNING_EVERY_S = 60.0  # a failing router signature is logged this often at most
# Per step: nodes whose G1 copies are re-read from the block pool (vLLM reports
# no G1 evictions), as many as the blocks the step schedules (each eviction
# from G1 makes room for one), at least G1_SWEEP_MIN and at most
# G1_SWEEP_MAX; and how often idle sessions are expired. A fixed 256 was 60 %
# of our work in a decode step of 64 requests (bench/scale.py).
G1_SWEEP_MIN, G1_SWEEP_MAX = 16, 256
EXPIRE_EVERY_S = 1.0
# Idle sessions ended per pass, counted as sessions plus the pinned and
# retained chunks they release (about 2 us each: bench/scale.py's expiry);
# when more are idle, the next pass goes on.
EXPIRE_PER_PASS = 1024
# Chunks whose storing session KV events remember, per G2 chunk: its G2
# copy's and the G3 cascade that follows within a few steps (connectors/kv_events.py).
EVENT_SESSIONS_PER_G2_CHUNK = 2


@dataclass
class _Tracked:
    """What the connector follows of one request (scheduler side)."""

    request: Request
    session: str | None
    hints: tuple[KvHint | HintOutcome, ...] = ()  # parsed on arrival, run at the end
    per_tier: bool = False  # its report may carry per-tier counts (report.per_tier)
    keys: list[bytes] = field(default_factory=list)  # OffloadKey per full block
    admitted: int = 0  # leading blocks the index holds as computed in G1
    due: int = 0  # tokens computed when the next block fills (admitted + 1)
    g1_tokens: int = 0  # G1 prefix hits of the last scheduling attempt
    sources: dict[CacheHitSource, int] = field(default_factory=dict)

    def admit_upto(self, n_blocks: int, block_size: int) -> None:
        self.admitted = n_blocks
        self.due = (n_blocks + 1) * block_size

    def keys_upto(self, n_blocks: int) -> list[bytes]:
        return self.keys_between(0, n_blocks)

    def keys_between(self, first: int, end: int) -> list[bytes]:
        keys, n = self.keys, len(self.keys)
        if n + 1 == end:  # a decode step's block
            keys.append(make_offload_key(self.request.block_hashes[n], 0))
        elif n < end:
            keys.extend(make_offload_key(h, 0) for h in self.request.block_hashes[n:end])
        return keys[first:end]


class SessionTierConnector(OffloadingConnector):
    """vLLM's offloading connector over sessionkv's tiers (see module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        kvt = vllm_config.kv_transfer_config
        bind_spec(kvt.kv_connector_extra_config)
        kvt.kv_connector_extra_config[IDENTITY_KEY] = model_identity(vllm_config)
        par = vllm_config.parallel_config
        check_supported(
            kvt.kv_role,
            kv_cache_config.kv_cache_groups,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
            has_device_worker(),
        )
        super().__init__(vllm_config, role, kv_cache_config)
        # Read once: ``manager`` and its lock are asked for several times a
        # step, each time through two properties of vLLM's before.
        self._manager: SessionTierManager | None = None
        if self.connector_scheduler is not None:
            manager = self.connector_scheduler.manager
            if not isinstance(manager, SessionTierManager):
                raise TypeError(
                    f"SessionTierConnector's offloading manager is "
                    f"{type(manager).__name__}, not a SessionTierManager"
                )
            self._manager = manager
        self._block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        # vLLM stores a request's output too only without offload_prompt_only.
        self._prompt_only = (
            self.connector_scheduler is not None
            and self.connector_scheduler.config.offload_prompt_only
        )
        self._tracked: dict[str, _Tracked] = {}
        self._signed_sessions: OrderedDict[str, None] = OrderedDict()  # scheduler thread
        self._next_sig_warning = 0.0
        self._fills = FillWatch()  # which of them to look at in a step (connectors/fills.py)
        self._next_expiry = 0.0
        self._in_pass = False  # the lock is held for the current schedule() pass
        self.control: ControlChannel | None = None
        if self.connector_scheduler is not None:
            if (
                vllm_config.kv_events_config is not None
                and vllm_config.kv_events_config.enable_kv_cache_events
            ):
                # G2 and G3 BlockStored events carry the storing session.
                cap = EVENT_SESSIONS_PER_G2_CHUNK * self.manager.primary_tier.num_chunks
                compat.replace_events_tracker(
                    self.scheduler, lambda t: SessionEventsTracker.replacing(t, cap)
                )
            self.control = start_control(
                self.manager,
                kvt.engine_id,
                par.data_parallel_rank,
                self._block_size,
                make_probe(vllm_config, self._block_size, self.manager),
                g1_blocks=kv_cache_config.num_blocks,
                dp_size=par.data_parallel_size,
            )

    def shutdown(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        super().shutdown()

    # ---- scheduler side -------------------------------------------------

    @property
    def manager(self) -> SessionTierManager:
        """The tier manager (scheduler side): owner of the lock, index and hints."""
        assert self._manager is not None, "scheduler side only"
        return self._manager

    @property
    def index(self) -> SessionPrefixIndex:
        return self.manager.index

    def _enter_pass(self) -> None:
        """Open the step's lock region at the first scheduler-side call of a
        ``schedule()`` pass (``compat.open_step``: vLLM's own region on 0.33)."""
        if not self._in_pass:
            waited = compat.open_step(self.scheduler, self.manager.lock)
            if waited:
                self.manager.stats.lock_waited(waited)
            self._in_pass = True
            self.manager.service.apply_moves()  # hint copies that ended become visible

    def _leave_pass(self) -> None:
        if self._in_pass:
            self._in_pass = False
            compat.close_step(self.scheduler, self.manager.lock)

    def _around_vllm(self) -> contextlib.AbstractContextManager:
        """The lock around a call into vLLM's hook outside the pass: on 0.33
        vLLM's hook takes it itself (``compat.VLLM_LOCKS_HOOKS``). The lock
        or a shared no-op, not a generator context: vLLM's scheduler calls
        such hooks every step, and the generator's enter and exit in
        ``update_connector_output`` alone were 1.5 % of our scheduler-side
        work (py-spy, 256 x 64k decode steps, 2026-12-06)."""
        return compat.NO_LOCK if self._in_pass or compat.VLLM_LOCKS_HOOKS else self.manager.lock

    def _locked(self) -> contextlib.AbstractContextManager:
        """The lock around our own manager work in a hook outside the pass;
        inside a pass the pass already holds it: never taken twice."""
        return compat.NO_LOCK if self._in_pass else self.manager.lock

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            pool, g2 = kv_cache_manager.block_pool, self.manager.primary_tier
            self.index.bind_g1_probe(g1_probe(pool))
            # What G1 and G2 hold is what the index holds in steady state.
            self.index.reserve(pool.num_gpu_blocks + g2.num_chunks * g2.blocks_per_chunk)

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        params = params if isinstance(params, dict) else {}
        given = request.session_id if request.session_id is not None else params.get(SESSION_PARAM)
        # An invalid id runs without a session; its hints get one rejected outcome.
        session = given if is_id(given) else None
        hints, signed = self._read_hints(request, params, given)
        session = self._joinable(session, signed)
        # Per-tier counts in its report: always with report.per_tier "all",
        # else only when the router signed it.
        per_tier = signed or self.manager.service.config.policy.report.per_tier == "all"
        self._tracked[request.request_id] = _Tracked(request, session, hints, per_tier)
        with self._around_vllm():
            super().on_new_request(request)

    def _joinable(self, session: str | None, signed: bool) -> str | None:
        """The session a request joins: its own, unless it is unsigned and a
        signed request named that session (then none: a stranger's blocks
        never join a router's session, where its Pins and Shares would cover
        them). O(1); at most ``MAX_SIGNED_SESSIONS`` remembered."""
        if session is None:
            return None
        seen = self._signed_sessions
        if signed:
            seen[session] = None
            seen.move_to_end(session)
            if len(seen) > MAX_SIGNED_SESSIONS:
                seen.popitem(last=False)
            return session
        return None if session in seen else session

    def _read_hints(
        self, request: Request, params: dict, session: Any
    ) -> tuple[tuple[KvHint | HintOutcome, ...], bool]:
        """Everything the request carries, parsed once (``read_request``), and
        whether the router signed it."""
        try:
            got = read_request(
                params, request.kv_hints, session, self.manager.service.config.policy.trust.secret
            )
            if got.problem and time.monotonic() >= self._next_sig_warning:
                self._next_sig_warning = time.monotonic() + SIG_WARNING_EVERY_S
                logger.warning(
                    "sessionkv: request %s: a router signature failed, its hints "
                    "act as unsigned: %s",
                    request.request_id,
                    got.problem,
                )
            return tuple(got.hints), got.signed
        except Exception:  # a parser bug must cost one hint, never the engine
            logger.exception("sessionkv: hints of request %s unreadable", request.request_id)
            return (
                HintOutcome(
                    "kv_hints", None, Status.REJECTED, reason="internal error reading hints"
                ),
            ), False

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._enter_pass()
        ext, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        tr = self._tracked.get(request.request_id)
        if tr is None:
            return ext, is_async
        # num_computed_tokens are the G1 prefix-cache hits of this attempt.
        tr.g1_tokens, tr.sources = num_computed_tokens, {}
        # Cache hits make the session a member though nothing is stored.
        bs = self._block_size
        g1 = num_computed_tokens // bs
        now = time.monotonic()
        if g1:
            self.index.admit(tr.session, tr.keys_upto(g1), Tier.G1, now=now)
            self._associated(tr, g1, Tier.G1)
        if ext:
            # G2 holds whole chunks: the chunk the load starts in is resident too.
            bpc = self.scheduler.config.blocks_per_chunk
            self.index.admit(
                tr.session, tr.keys_upto(g1 + ext // bs), Tier.G2, start=g1 - g1 % bpc, now=now
            )
            self._associated(tr, g1 + ext // bs, Tier.G2)
        # A (re)scheduled request, preempted ones included, computes from here.
        tr.admit_upto(g1 + (ext or 0) // bs, bs)
        self._fills.look_now(request.request_id)
        return ext, is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        self._enter_pass()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        # Called again with 0 when a request resumes after its async load;
        # only an allocation that loads something carries a load plan.
        tr = self._tracked.get(request.request_id)
        if num_external_tokens > 0 and tr is not None:
            # The split by tier exists only once the load is planned (above).
            tr.sources = self.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        self._enter_pass()
        try:
            meta = super().build_connector_meta(scheduler_output)
            with compat.after_vllm_step(self.manager.lock):
                self._after_step(scheduler_output)
            return meta
        finally:
            self._leave_pass()

    def _after_step(self, scheduler_output: SchedulerOutput) -> None:
        # Full-block admission and decode-block completion: blocks this step
        # fills are cached in G1 now (vLLM caches them at allocation).
        bs, now, index, tracked = self._block_size, time.monotonic(), self.index, self._tracked
        scheduled, total = (
            scheduler_output.num_scheduled_tokens,
            scheduler_output.total_num_scheduled_tokens,
        )
        fills = self._fills
        filled: list[tuple[_Tracked, int, int]] = []  # (request, blocks before, after)
        for req_id in fills.step(scheduled, total):  # those that may fill a block now
            tr = tracked.get(req_id)
            if tr is None:
                fills.forget(req_id)
                continue
            n_sched = scheduled.get(req_id)
            if n_sched is None:  # not scheduled in this step
                fills.file(req_id, 1)
                continue
            computed = tr.request.num_computed_tokens + n_sched
            if computed >= tr.due:
                full = min(len(tr.request.block_hashes), computed // bs)
                if full > tr.admitted:
                    filled.append((tr, tr.admitted, full))
                    tr.admit_upto(full, bs)
            fills.file(req_id, min(tr.due - computed, bs))
        if filled:
            self._admit_filled(filled, now)
        index.sweep_g1(min(G1_SWEEP_MAX, max(G1_SWEEP_MIN, total // bs)))
        self.manager.service.collect_clipped()
        if now >= self._next_expiry:
            more = self.manager.service.expire_sessions(now, EXPIRE_PER_PASS)
            self._next_expiry = now if more else now + EXPIRE_EVERY_S

    def _admit_filled(self, filled: list[tuple[_Tracked, int, int]], now: float) -> None:
        """The index learns the blocks this step filled (``(request, blocks
        admitted before, full blocks now)`` each): an ``extend`` below the
        blocks admitted before; the whole chain for a request that had none,
        or whose last one was pruned meanwhile."""
        index = self.index
        below: list[tuple[str | None, bytes, list[bytes]]] = []  # extends, in one call
        below_of: list[tuple[_Tracked, int, int]] = []
        for f in filled:
            tr, start, full = f
            new = tr.keys_between(start, full)
            if start:
                below.append((tr.session, tr.keys[start - 1], new))
                below_of.append(f)
            else:
                index.admit(tr.session, tr.keys_upto(full), Tier.G1, now=now)
        for i in index.extend_each(below, Tier.G1, now):
            tr, start, full = below_of[i]
            index.admit(tr.session, tr.keys_upto(full), Tier.G1, start=start, now=now)
        if self.manager.event_log is not None:
            for tr, _, full in filled:
                self._associated(tr, full, Tier.G1)

    def _associated(self, tr: _Tracked, n_blocks: int, tier: Tier) -> None:
        events = self.manager.event_log
        if events is not None and tr.session is not None:
            events.append(
                Association(
                    session_id=tr.session,
                    op=Op.EXTEND,
                    tier=cast(TierName, tier.name),
                    blocks=n_blocks,
                    frontier=tr.keys[n_blocks - 1],
                )
            )

    def _turn(self, tr: _Tracked, request: Request) -> Turn | None:
        """A finished request's full blocks up to vLLM's last store of it (its
        last computed token; with async scheduling the block its last tokens
        filled is hashed only when it finished) join the index; its chunks
        vLLM stores (its prompt's only, with ``offload_prompt_only``), which
        its hints cover to the end, when it has hints."""
        bs = self._block_size
        end = min(
            request.num_computed_tokens, max(request.num_prompt_tokens, request.num_tokens - 1)
        )
        full = min(len(request.block_hashes), end // bs)
        if full > tr.admitted:
            self._admit_filled([(tr, tr.admitted, full)], time.monotonic())
            tr.admit_upto(full, bs)
        if not tr.hints:
            return None
        bpc = self.manager.primary_tier.blocks_per_chunk
        if self._prompt_only:
            full = min(full, request.num_prompt_tokens // bs)
        return Turn(request.request_id, tr.keys_upto(full)[bpc - 1 :: bpc])

    def _report(self, request: Request) -> RequestReport:
        tr = self._tracked.pop(request.request_id, None)
        self._fills.forget(request.request_id)
        g1, sources = (tr.g1_tokens, tr.sources) if tr else (0, {})
        g2 = sources.get(CacheHitSource.HOST, 0)
        g3 = sum(sources.values()) - g2
        turn = self._turn(tr, request) if tr else None
        report = RequestReport.build(
            hints=self.manager.service.execute_request_hints(tr.hints, tr.session, turn)
            if tr
            else (),
            session_id=tr.session if tr else None,
            block_size=self._block_size,
            prompt_tokens=request.num_prompt_tokens,
            g1_tokens=g1,
            g2_tokens=g2,
            g3_tokens=g3,
        )
        self.manager.stats.tokens(report)
        return report if tr is not None and tr.per_tier else report.totals_only()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._around_vllm():
            delay, params = super().request_finished(request, block_ids)
        with self._locked():
            return delay, {**(params or {}), **self._report(request).to_params()}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The path vLLM's scheduler takes for connectors that support HMA (ours).
        with self._around_vllm():
            delay, params = super().request_finished_all_groups(request, block_ids)
        with self._locked():
            return delay, {**(params or {}), **self._report(request).to_params()}

    def update_connector_output(self, connector_output) -> None:
        with self._around_vllm():
            super().update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        with self._around_vllm():
            return super().reset_cache()

    def take_events(self):
        with self._around_vllm():
            return list(super().take_events())

    def get_kv_connector_stats(self):
        if self.connector_scheduler is None:
            return super().get_kv_connector_stats()
        with self._around_vllm():
            return super().get_kv_connector_stats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        # Built in the API server process, where no connector instance ran.
        bind_spec(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
