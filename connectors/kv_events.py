"""Session-tagged KV events for the offloaded tiers.

vLLM's KV event publisher (``--kv-events-config``, what llm-d's indexer and
Dynamo's router consume) tags device blocks' ``BlockStored`` with the
request's ``session_id``, on every store and every prefix-cache reuse; the
``BlockStored`` events its offloading connector sends for G2 (``medium``
"CPU") and the secondary tiers carry none, and are not repeated on reuse.
``SessionEventsTracker`` is vLLM's ``OffloadingEventsTracker`` that also
remembers, per chunk, which requests stored it or reused it from the
offloaded tiers, and sets ``session_id`` on a ``BlockStored`` of the chunk
(the G2 store, the G3 cascades and hint copies, which run with no request)
only when it is one session's alone: every request seen with the chunk
belongs to that session. A chunk seen with two sessions, or with a request
without a session, is shared and goes untagged: no session is named the
owner of what several use (reuse from the device prefix cache alone is not
seen here; vLLM's device events report it, tagged with the reusing
session). ``BlockRemoved`` has no ``session_id`` field: removals go out as
vLLM makes them (G3's: ``tiers/g3/events.py``).

Invariants: events are vLLM's own, in vLLM's order, with only
``session_id`` set; a chunk no session stored is left untagged.
Memory: at most ``cap`` chunks' users (the least recently seen go first: a
G3 cascade follows its G2 store within a few steps).
Threading: the scheduler thread, as vLLM's tracker.
Installed only when KV events are on (``enable_kv_cache_events``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import msgspec
from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import OffloadingEvent

from sessionkv.tiers import compat

# A chunk's users: a session id, None (requests without one), or this.
_SHARED = object()


class SessionEventsTracker(compat.StoredEventHook, OffloadingEventsTracker):
    """vLLM's tracker, plus each chunk's sole session (module docstring)."""

    _sessions: OrderedDict
    _cap: int

    @classmethod
    def replacing(cls, tracker: OffloadingEventsTracker, cap: int) -> SessionEventsTracker:
        """This tracker in place of vLLM's just-built ``tracker`` (whose
        constructor differs between releases: its state is taken over as is)."""
        if cap <= 0:
            raise ValueError(f"cap must be positive, got {cap!r}")
        new = cls.__new__(cls)
        new.__dict__.update(tracker.__dict__)
        new._sessions, new._cap = OrderedDict(), cap
        return new

    def _remember(self, req, key) -> None:
        session = getattr(req, "session_id", None)
        if not isinstance(session, str) or not session:
            session = None
        users = self._sessions
        if key not in users:
            users[key] = session
            if len(users) > self._cap:
                users.popitem(last=False)
            return
        if users[key] != session:  # another session, or none: shared
            users[key] = _SHARED
        users.move_to_end(key)

    def record_store(self, req, group_config, chunk_idx, offload_key) -> None:
        self._remember(req, offload_key)
        super().record_store(req, group_config, chunk_idx, offload_key)

    def record_lookup(self, req, group_config, chunk_idx, offload_key) -> None:
        self._remember(req, offload_key)
        super().record_lookup(req, group_config, chunk_idx, offload_key)

    def record_partial_store(self, req, group_config, boundary_tokens, offload_key) -> None:
        self._remember(req, offload_key)
        super().record_partial_store(req, group_config, boundary_tokens, offload_key)

    def record_partial_lookup(self, req, group_config, boundary_tokens, offload_key) -> None:
        self._remember(req, offload_key)
        super().record_partial_lookup(req, group_config, boundary_tokens, offload_key)

    def stored_events(
        self, event: OffloadingEvent, outs: list[KVCacheEvent]
    ) -> Iterable[KVCacheEvent]:
        # vLLM yields one BlockStored per key, in the event's key order; were
        # that to change, its events go out untagged rather than mismatched.
        if len(outs) != len(event.keys):
            yield from outs
            return
        for key, out in zip(event.keys, outs):
            session = self._sessions.get(key)
            if isinstance(session, str) and isinstance(out, BlockStored):
                out = msgspec.structs.replace(out, session_id=session)
            yield out

    def reset(self) -> None:
        super().reset()
        self._sessions.clear()
