"""Every "what to hint and when" of the router, in one class with the clock
injected and no I/O: ``HintPlanner``. The HTTP app (``app.py``) calls it at
each lifecycle event and gets data back (``Hint``, ``Send``, ``End`` and the
plans below); it only transports them: signs and sends them on the request
or over the control channel, awaits them, counts their outcomes. The trace
replay (``bench/replay_router.py``) runs the same planner on trace time.

Lifecycle to hints (``policy`` in router.yaml), in the order the app calls:

| event | call | hints |
| --- | --- | --- |
| a turn arrives | ``tool_gap``, ``request_hints`` | with ``tool_call.pin``, when the client says the turn ends in a tool call (``X-Session-Tool-Gap: <s>`` or ``default``): a Pin on the request, TTL = gap x ``pin_ttl_factor``, within the client's Pin quota |
| it goes to a worker | ``turn_started`` | the Retain ranking's (``retains.SessionHints``), paced |
| ... which is a move | ``move``, ``Move.prefetch`` | Share from the old worker (its final outcome awaited up to ``move_wait_s``); with ``share_prefetch`` a Prefetch of the shared chunks on the new one; then the old worker ends the session. Nothing from an unhealthy one (a failover) |
| its response finished | ``turn_answered`` | a response ending in ``tool_calls`` that the client did not announce, with ``tool_call.pin``: the same Pin over the control channel, for ``expected_gap_s``; with ``warmup.enabled`` and a gap: a one-token replay of the prompt ``lead_s`` before the gap's expected end |
| the turn is recorded | ``turn_ended`` | the ranking's Retain of the session, paced |
| a session ends | ``session_ending``, ``session_ended`` | ``demote``: a Demote on its worker first; unless ``none``: an end on every worker it used; then the ranking's hints (its head watched) |
| a worker drains | ``drain`` | a Demote of each session last sent there, each awaited up to ``move_wait_s`` |
| every second | ``tick`` | the ranking's paced and re-ranked Retains |

Each call reads the clock when it is made, so the app makes it at the moment
the event happens, after the awaits before it: that is why a turn's end and
a session's end are two calls each (the Pin or the Demote is awaited
between them).

Memory: the ranking's (``retains``), and a Pin quota of at most
``max_sessions`` clients. Threading: none; one caller (the router's event
loop, or the replay).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessionkv.events import Transfer
from sessionkv.hints import Action, hint_action
from sessionkv.router.config import HintPolicy
from sessionkv.router.retain_queue import End, Out, Send
from sessionkv.router.retains import SessionHints

__all__ = [
    "TOOL_GAP_HEADER",
    "End",
    "Hint",
    "HintPlanner",
    "Move",
    "Out",
    "PinQuota",
    "RequestHints",
    "Send",
    "TurnEnd",
    "Warmup",
    "chunk_ends_in_tool_call",
    "ends_in_tool_call",
    "tool_gap_from_header",
]

TOOL_GAP_HEADER = "X-Session-Tool-Gap"


@dataclass(frozen=True)
class Hint:
    """One control-channel hint about ``session`` for ``worker``, sent alone
    and awaited (counted as ``control``); with ``wait_s``, a deferred one's
    final outcome and transfer are then awaited that long. ``params``: the
    action's own (``ttl_s``, ``destination``, ``keys``)."""

    worker: str
    action: Action
    session: str
    wait_s: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestHints:
    """What a turn carries to its engine, signed (``kv_transfer_params``):
    ``actions`` (none: the turn is signed all the same); ``over_quota``: a
    Pin the client's quota refused."""

    actions: list[dict[str, Any]]
    over_quota: bool = False


@dataclass(frozen=True)
class Warmup:
    """A one-token replay of ``session``'s last prompt ``delay_s`` after its
    turn ended, unless a turn of it came first."""

    session: str
    delay_s: float


@dataclass(frozen=True)
class TurnEnd:
    """A turn's end, decided when its response finished: ``gap_s``, the tool
    gap the session state records (None: none); ``hints``, sent and awaited
    before the state is written (a tool call's Pin); ``over_quota``, a Pin
    the client's quota refused; ``warmup``, one to schedule."""

    gap_s: float | None
    hints: list[Hint]
    over_quota: bool = False
    warmup: Warmup | None = None


@dataclass(frozen=True)
class Move:
    """A session's move from ``old`` to ``new`` (routing chose it).
    ``failover``: ``old`` is unhealthy, nothing is sent (the data went with
    the engine; the new worker finds what write-through put in G3). Else, in
    order: ``share`` (its final outcome awaited), ``prefetch`` of what it
    copied, ``end`` on ``old``; none of them with ``on_move: none``."""

    session: str
    old: str
    new: str
    failover: bool = False
    share: Hint | None = None
    end: End | None = None
    prefetch_wait_s: float | None = None  # share_prefetch: how long a Prefetch is awaited

    def prefetch(self, moved: Transfer | None) -> Hint | None:
        """The Prefetch on ``new`` of the chunks the Share copied (``moved``:
        its transfer, None when its final outcome did not come in time)."""
        if self.prefetch_wait_s is None or moved is None or not moved.keys:
            return None
        return Hint(
            self.new,
            Action.PREFETCH,
            self.session,
            self.prefetch_wait_s,
            {"keys": list(moved.keys)},
        )


def tool_gap_from_header(value: str | None, policy: HintPolicy) -> float | None:
    """``X-Session-Tool-Gap: <seconds>`` (or ``default``): the client says this
    turn ends in a tool call expected to last that long. ValueError when malformed."""
    if value is None:
        return None
    if value.strip().lower() in ("", "default"):
        return policy.tool_call.expected_gap_s
    gap = float(value)
    if not 0 < gap < 1e6:
        raise ValueError(f"{TOOL_GAP_HEADER} must be a positive number of seconds")
    return gap


def ends_in_tool_call(response: Mapping[str, Any]) -> bool:
    """Whether an OpenAI response's turn ended in a tool call."""
    for choice in response.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if choice.get("finish_reason") == "tool_calls":
            return True
        message = choice.get("message")
        if isinstance(message, Mapping) and message.get("tool_calls"):
            return True
    return False


def chunk_ends_in_tool_call(chunk: bytes) -> bool:
    """Whether a chunk of a streamed response finishes its turn in a tool call."""
    return b'"finish_reason":"tool_calls"' in chunk.replace(b" ", b"")


class PinQuota:
    """Router Pins per client (not per session id, which clients choose):
    each client holds Pins for at most ``per_client`` sessions at once, a
    Pin counting until its TTL ends. At most ``max_clients`` clients are
    remembered (least recently pinning first out), each with at most
    ``per_client`` entries, so the map is bounded.

    Threading: one caller."""

    def __init__(self, per_client: int, max_clients: int, clock: Callable[[], float]):
        self._per = per_client
        self._max = max_clients
        self._clock = clock
        self._pins: OrderedDict[str, dict[str, float]] = OrderedDict()

    def take(self, client: str, session_id: str, ttl_s: float) -> bool:
        """Record a Pin of ``session_id`` for ``ttl_s``; False (nothing
        recorded) when the client already holds its quota of other sessions."""
        now = self._clock()
        held = {s: t for s, t in self._pins.pop(client, {}).items() if t > now}
        if session_id not in held and len(held) >= self._per:
            self._pins[client] = held
            return False
        held[session_id] = now + ttl_s
        self._pins[client] = held
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)
        return True


class HintPlanner:
    """What the router hints and when (see the module docstring). ``retains``:
    the Retain ranking it owns (``SessionHints``)."""

    def __init__(self, cfg: HintPolicy, clock: Callable[[], float]):
        self.cfg = cfg
        self.retains = SessionHints(cfg, clock)
        self._pins = PinQuota(cfg.tool_call.max_pins_per_client, cfg.max_sessions, clock)

    # ---- engines --------------------------------------------------------------------

    def add_engine(self, name: str, g2_blocks: int, g1_blocks: int, hints_per_s: float) -> None:
        """An engine the ranking hints (G2 blocks, G1 blocks, its per-client hint rate)."""
        self.retains.add_engine(name, g2_blocks, g1_blocks, hints_per_s)

    def add_engine_hello(self, name: str, hello: Mapping[str, Any]) -> str | None:
        """An engine sized from its ``hello`` (G2 chunks x blocks per chunk,
        G1 blocks, hint rate); the problem when those are unreadable (an old
        engine's hello lacks them: its shadows then model a 1-block G2)."""
        problem = None
        try:
            g2 = int(hello.get("g2_chunks", 0)) * int(hello.get("blocks_per_chunk", 1))
            g1, rate = int(hello.get("g1_blocks", 0)), float(hello.get("hints_per_s", 100.0))
        except (TypeError, ValueError) as e:
            problem = str(e)
            g2, g1, rate = 0, 0, 100.0
        self.add_engine(name, g2, g1, rate)
        return problem

    # ---- a turn ---------------------------------------------------------------------

    def tool_gap(self, header: str | None) -> float | None:
        """The tool gap the client announced (``TOOL_GAP_HEADER``'s value);
        ValueError when malformed."""
        return tool_gap_from_header(header, self.cfg)

    @property
    def tokenizes_text(self) -> bool:
        """Whether a text or chat prompt is worth the engine's tokenization
        (its keys): only while a strategy that Retains sessions may run."""
        return self.cfg.strategy != "plain"

    @property
    def keeps_bodies(self) -> bool:
        """Whether turns' bodies are kept for warm-ups."""
        return self.cfg.warmup.enabled

    def request_hints(self, session: str, client: str, gap_s: float | None) -> RequestHints:
        """The hints a turn carries: a tool gap's Pin (see the module docstring)."""
        if gap_s is None or not self.cfg.tool_call.pin:
            return RequestHints([])
        ttl = self._pin_ttl(gap_s)
        if not self._pins.take(client, session, ttl):
            return RequestHints([], over_quota=True)
        return RequestHints([hint_action(Action.PIN, ttl_s=ttl)])

    def turn_started(
        self, session: str, worker: str, keys: Sequence[bytes], extra: Sequence[bytes] = ()
    ) -> list[Send]:
        """The turn goes to ``worker`` (``SessionHints.turn_started``)."""
        return self.retains.turn_started(session, worker, keys, extra)

    def move(self, session: str, old: str, new: str, old_healthy: bool) -> Move:
        """Routing moves the session from ``old`` to ``new`` (``on_move``)."""
        if not old_healthy:
            return Move(session, old, new, failover=True)
        if self.cfg.on_move == "none":
            return Move(session, old, new)
        wait = self.cfg.move_wait_s
        return Move(
            session,
            old,
            new,
            share=Hint(old, Action.SHARE, session, wait, {"destination": new}),
            end=End(old, session),
            prefetch_wait_s=wait if self.cfg.on_move == "share_prefetch" else None,
        )

    def turn_answered(
        self, session: str, worker: str, client: str, gap_s: float | None, tool_call: bool
    ) -> TurnEnd:
        """The turn's response finished on ``worker``; ``gap_s``: the tool gap
        the client announced; ``tool_call``: the response ended in one."""
        hints: list[Hint] = []
        over_quota = False
        if gap_s is None and tool_call and self.cfg.tool_call.pin:
            gap_s = self.cfg.tool_call.expected_gap_s
            ttl = self._pin_ttl(gap_s)
            if self._pins.take(client, session, ttl):
                hints.append(Hint(worker, Action.PIN, session, params={"ttl_s": ttl}))
            else:
                over_quota = True
        warmup = None
        if gap_s is not None and self.cfg.warmup.enabled:
            warmup = Warmup(session, max(0.0, gap_s - self.cfg.warmup.lead_s))
        return TurnEnd(gap_s, hints, over_quota, warmup)

    def turn_ended(self, session: str) -> list[Send]:
        """The turn is over and the session goes on (``SessionHints.turn_ended``);
        also when its client hung up."""
        return self.retains.turn_ended(session)

    @staticmethod
    def warmup_body(body: Mapping[str, Any]) -> dict[str, Any]:
        """A warm-up's request: the turn's body for one token, not streamed."""
        return {**body, "max_tokens": 1, "stream": False}

    # ---- a session's end --------------------------------------------------------------

    def session_ending(self, session: str, worker: str | None) -> list[Hint]:
        """Before a session's end on ``worker`` (the one its state names; None
        when unknown here): a Demote with ``on_end: demote``."""
        if worker is not None and self.cfg.on_end == "demote":
            return [Hint(worker, Action.DEMOTE, session)]
        return []

    def session_ended(self, session: str, worker: str | None = None) -> list[Out]:
        """The session is over: its ends (awaited: ended when the app's end
        returns), on every worker its turns went to, or on ``worker`` when
        the ranking did not see them (they went through another replica);
        none with ``on_end: none``; then the ranking's hints (paced)."""
        outs = self.retains.session_ended(session)
        ends: list[Out] = [o for o in outs if isinstance(o, End)]
        if not ends and worker is not None:
            ends = [End(worker, session)]
        if self.cfg.on_end == "none":
            ends = []
        return [*ends, *(o for o in outs if not isinstance(o, End))]

    def drain(self, worker: str) -> list[Hint]:
        """A worker drains (before its engine stops): a Demote of every live
        session last sent there, each awaited up to ``move_wait_s``."""
        return [
            Hint(worker, Action.DEMOTE, s, self.cfg.move_wait_s)
            for s in self.retains.sessions_on(worker)
        ]

    # ---- time and outcomes ------------------------------------------------------------

    def tick(self) -> list[Send]:
        """Paced and re-ranked Retains (``SessionHints.tick``); call every second."""
        return self.retains.tick()

    def outcome(self, action: str, status: str) -> None:
        """What one of the ranking's hints became."""
        self.retains.outcome(action, status)

    def status(self) -> dict[str, Any]:
        """The ranking's status (``/router/status``'s ``policy``)."""
        return self.retains.status()

    def _pin_ttl(self, gap_s: float) -> float:
        """How long a tool gap's Pin holds (the engine clips it to its own limit)."""
        return gap_s * self.cfg.tool_call.pin_ttl_factor
