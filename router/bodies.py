"""Each session's last request body, kept for its warm-up (``HintPlanner``'s
``Warmup``, with ``policy.warmup.enabled``): the path it went to, the body
as forwarded, its size in bytes and the client's ``Authorization``.

Bounded: at most ``max_sessions`` bodies and ``max_bytes`` in all, least
recently kept out first; a body larger than ``max_bytes`` is not kept.
Threading: the router's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple


class Kept(NamedTuple):
    path: str
    body: dict[str, Any]
    size: int
    auth: str | None


class LastBodies:
    """Sessions' last bodies (see the module docstring)."""

    def __init__(self, max_sessions: int, max_bytes: int):
        self._max_sessions = max_sessions
        self._max_bytes = max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0

    def keep(
        self, session_id: str, path: str, body: dict[str, Any], size: int, auth: str | None
    ) -> None:
        """Keep the session's last body (``size``: its request's bytes) and
        the client's ``Authorization``, in place of the one before."""
        self.drop(session_id)
        if size > self._max_bytes:
            return
        self._kept[session_id] = Kept(path, body, size, auth)
        self._bytes += size
        while len(self._kept) > self._max_sessions or self._bytes > self._max_bytes:
            self.drop(next(iter(self._kept)))

    def drop(self, session_id: str) -> None:
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            self._bytes -= kept.size

    def get(self, session_id: str) -> Kept | None:
        return self._kept.get(session_id)
