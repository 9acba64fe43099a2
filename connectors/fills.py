"""FillWatch: which requests can fill a KV block in a scheduler step, without
looking at every running request each step.

The connector admits a request's blocks to the index in the step that fills
them (``SessionTierConnector._after_step``). A decode step fills a block of
one request in ``block_size``; asking every request whether it is due cost
about 0.15 ms of a 256-request decode step at 64k tokens (bench/scale.py's
schedule, timed by function), to find the 16 that were. So each request is filed under the first step that could
fill its next block, and a step looks at the requests filed under it:

- a step that schedules one token per request (``total_num_scheduled_tokens
  == len(num_scheduled_tokens)``: every scheduled request gets at least one,
  so none gets more) advances each request by at most one token, and a
  request ``n`` tokens short of its next block cannot fill it in under ``n``
  such steps;
- a step that schedules more for some request (prefill chunks, speculative
  decoding) looks at every request it schedules, as the connector did before;
- a request whose count the connector reset this pass (scheduled afresh:
  ``look_now``) is looked at in this step;
- a request looked at but not scheduled is filed under the next step.

So a pure decode step costs the requests due in it, and no request is looked
at later than the step that fills its block.

Invariants: a request's filing is the step in ``_filed``; entries of ``_at``
for another step are stale and skipped.

Threading: not thread-safe; one owner (the connector, on the scheduler thread).

Memory: ``_filed`` has one entry per followed request (``forget`` drops it);
``_at`` holds steps at most ``block_size`` ahead (a request is never filed
further than the tokens left in its block), each entry one filing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class FillWatch:
    """The steps at which requests are looked at (see the module docstring)."""

    def __init__(self) -> None:
        self._step = 0
        self._filed: dict[str, int] = {}
        self._at: dict[int, list[str]] = {}
        self._now: list[str] = []

    def __len__(self) -> int:
        return len(self._filed)

    def look_now(self, req_id: str) -> None:
        """Look at ``req_id`` in this pass's step (its count was reset)."""
        self._now.append(req_id)

    def step(self, scheduled: Mapping[str, int], total_tokens: int) -> Iterable[str]:
        """Start the next step: the requests to look at in it, once each. Every
        one of them that is still followed must be ``file``d again."""
        step = self._step = self._step + 1
        filed = self._filed
        look = [r for r in self._at.pop(step, ()) if filed.get(r) == step]
        if self._now:
            look += self._now
            self._now = []
        if total_tokens != len(scheduled):
            look += scheduled
        return dict.fromkeys(look) if len(look) > 1 else look

    def file(self, req_id: str, tokens_short: int) -> None:
        """Look at ``req_id`` again in the first step that can add its
        ``tokens_short`` tokens at one per step (the next step when <= 1)."""
        at = self._step + max(1, tokens_short)
        self._filed[req_id] = at
        self._at.setdefault(at, []).append(req_id)

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: not looked at again."""
        self._filed.pop(req_id, None)
