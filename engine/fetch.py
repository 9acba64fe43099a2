"""KVCR's ``kv.fetch``: blocks another engine holds, copied into this one.

A ``kv.fetch`` names blocks by their 64-bit hashes (as KV events report
them) and the source engine's control endpoint. Only the source can map
those hashes to chunk keys, so a fetch takes three steps, on a thread of its
own (network waits never hold the tier manager's lock):

1. ``resolve`` on the source: the chunk keys of the named blocks it holds;
2. a Share of those keys on the source (it publishes them to G3), its final
   outcome awaited on the source's event stream;
3. under the lock, a Prefetch of the keys here (``Mover.start``): the blocks
   become loadable only once all their bytes are in G2, so a request racing
   the fetch waits for them or recomputes.

The hint's first outcome is ``deferred``; its final one (the Prefetch's, or
why a step failed: ``missing`` when the source holds none of the blocks,
``rejected`` when it cannot be reached or refuses) is an ``Outcome`` event.
The source must trust this engine's secret (one secret per cluster).

Threading: ``start`` from any thread (the caller holds the lock); the steps
run on ``MAX_FETCHES`` worker threads, further fetches queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sessionkv.client import ControlError, HintClient
from sessionkv.hints import HashesTarget, HintOutcome, KvHint, Status, envelope, hint_action

logger = logging.getLogger(__name__)
MAX_FETCHES = 2
TIMEOUT_S = 30.0

#: Called on a fetch thread with (hint, chunk keys, blocks asked): starts the
#: Prefetch under the lock and emits its outcome if it is final at once.
StartPrefetch = Callable[[KvHint, list[bytes], int], None]
#: Called on a fetch thread with a final outcome to emit.
Emit = Callable[[HintOutcome], None]


class Fetcher:
    """Runs ``kv.fetch`` hints (see the module docstring)."""

    def __init__(
        self, secret: bytes, prefetch: StartPrefetch, emit: Emit, timeout_s: float = TIMEOUT_S
    ):
        self._secret = secret
        self._prefetch = prefetch
        self._emit = emit
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(MAX_FETCHES, thread_name_prefix="sessionkv-fetch")

    def start(self, hint: KvHint) -> HintOutcome:
        """Queue the fetch of a ``HashesTarget`` hint with a ``source``; its
        first outcome (``deferred``)."""
        assert isinstance(hint.target, HashesTarget)  # the executor sends only these
        asked = len(hint.target.block_hashes)
        self._pool.submit(self._run, hint, asked)
        return self._outcome(hint, Status.DEFERRED, f"fetching from {hint.source}", asked)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _outcome(hint: KvHint, status: Status, reason: str, asked: int) -> HintOutcome:
        return HintOutcome(hint.hint_id, hint.action.action_type, status, asked, 0, reason)

    def _run(self, hint: KvHint, asked: int) -> None:
        try:
            failed = self._steps(hint, asked)
        except (ControlError, OSError) as e:
            failed = (Status.REJECTED, f"source failed: {e}")  # e names the source
        except Exception:  # a bug costs this hint, never the thread
            logger.exception("sessionkv: kv.fetch %s failed", hint.hint_id)
            failed = (Status.REJECTED, "internal error")
        if failed is not None:
            self._emit(self._outcome(hint, *failed, asked))

    def _steps(self, hint: KvHint, asked: int) -> tuple[Status, str] | None:
        """Steps 1-3; what failed, or None once the Prefetch started."""
        assert hint.source is not None and isinstance(hint.target, HashesTarget)  # start's
        with HintClient(hint.source, self._secret, timeout_s=self._timeout_s) as src:
            keys = src.resolve(list(hint.target.block_hashes))
            if not keys:
                return Status.MISSING, "the source holds none of the blocks"
            after = src.events(after=0, limit=1).next_seq - 1
            (first,) = src.hints(envelope(hint_action("share", keys=keys, destination="kv.fetch")))
            final = first
            if first.status is Status.DEFERRED:
                final = src.final_outcome(first.hint_id, after, self._timeout_s)
            if final.status not in (Status.ACCEPTED, Status.CLIPPED):
                return (
                    Status.MISSING if final.status is Status.MISSING else Status.REJECTED,
                    f"the source's share: {final.status.value} {final.reason}".rstrip(),
                )
        self._prefetch(hint, keys, asked)
        return None
