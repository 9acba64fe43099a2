"""The router's configuration: ``router.yaml``, parsed once into frozen dataclasses.

::

    version: 1
    listen: {host: 127.0.0.1, port: 8100,
             header_timeout_s: 75,  # a connection without a whole request head by then
                                    # (after it opened, or idle after its last response)
                                    # closes: a proxy in front must idle out sooner
             body_timeout_s: 30}    # a body that has not arrived by then is a 400
    secret_file: router.key        # the engines' trust.secret_file key (>= 16 bytes)
    redis: {url: "redis://127.0.0.1:6379/0", namespace: sessionkv-router, state_ttl_s: 86400,
            timeout_s: 1.0,        # every call's connect and socket timeout
            retry_s: 5.0}          # after a failure, route from memory this long, then try
    workers:                       # >= 1; names are what Share's destination says
      - {name: a, url: "http://127.0.0.1:8001", endpoint_file: /run/engine-a.json}
      - {name: b, url: "http://127.0.0.1:8002", control: "tcp://127.0.0.1:5702"}
      - {name: c, url: "http://127.0.0.1:8003", plain: true}   # no connector: no hints
    routing:
      max_load: 4                  # a session leaves a worker with this many requests
      load_poll_s: 0.5             # how often engines' /metrics are read
      request_timeout_s: 600
      overlap: true                # new and moving sessions go where their prefix is
      overlap_g2_weight: 0.5       # a G2 block counts this much of a G1 block
      retry: true                  # a turn whose worker died is sent to another one
    policy:
      strategy: auto               # or one of retain_queue.STRATEGIES: recency+shared,
                                   # density+shared, recency, density, plain
      tick_s: 30                   # how often idle sessions are re-ranked
      watch_s: 600                 # router-owned Retains (shared prefixes, heads) last this long
      shadow_blocks: 65536         # per engine and strategy, keys a shadow cache holds at most
      max_sessions: 100000         # live sessions the policy tracks (least recent forgotten)
      max_blocks: 1000000          # first-seen blocks remembered to find shared prefixes
      prior_gap_s: 120             # the wait between turns assumed before any is seen
      tool_call: {pin: false, expected_gap_s: 60, pin_ttl_factor: 1.5}
      on_end: free                 # free | demote | none
      idle_timeout_s: 600          # a session with no turn for this long ends
      on_move: share               # share | share_prefetch | none
      move_wait_s: 10              # how long a move waits for its copies' final outcomes
      warmup: {enabled: false, lead_s: 2.0,
               max_bytes: 67108864}   # last request bodies kept for warm-ups, in all

Every key but ``secret_file``, ``redis.url`` and ``workers`` is optional (the
defaults shown). An unknown key, a wrong type or a missing file is a
``ValueError`` naming the key. Nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from sessionkv.config import MAX_INT, MAX_NUMBER, load_yaml, mapping_of
from sessionkv.hints import id_problem

END_ACTIONS = ("demote", "free", "none")
STRATEGIES = ("auto", "recency+shared", "density+shared", "recency", "density", "plain")
MOVE_ACTIONS = ("share", "share_prefetch", "none")


@dataclass(frozen=True)
class WorkerConfig:
    """One engine: its OpenAI URL and its control channel (an endpoint, or the
    endpoint file the engine writes, read when the router starts). ``plain``:
    an engine without the connector (no control channel: no hints, events or
    overlap; affinity and load only)."""

    name: str
    url: str
    control: str | None = None
    endpoint_file: str | None = None
    plain: bool = False


@dataclass(frozen=True)
class RedisConfig:
    url: str
    namespace: str = "sessionkv-router"
    state_ttl_s: float = 86400.0  # a session's record outlives its last turn this long
    timeout_s: float = 1.0  # connect and socket timeout of every Redis call
    retry_s: float = 5.0  # after a failed call, route from memory this long


@dataclass(frozen=True)
class RoutingConfig:
    max_load: int = 4  # requests running + waiting at which a session moves
    load_poll_s: float = 0.5
    request_timeout_s: float = 600.0
    overlap: bool = True  # score workers by the prompt's prefix blocks they hold
    overlap_g2_weight: float = 0.5
    retry: bool = True  # retry a turn whose worker died (see app.py)


@dataclass(frozen=True)
class ToolCallPolicy:
    pin: bool = False  # also Pin through a tool gap (Retains do by default)
    expected_gap_s: float = 60.0  # when the client does not say
    pin_ttl_factor: float = 1.5  # Pin TTL = expected gap x this
    max_pins_per_client: int = 16  # sessions one client may hold router Pins for at once


@dataclass(frozen=True)
class WarmupPolicy:
    enabled: bool = False
    lead_s: float = 2.0  # the warm-up goes this long before the expected return
    max_bytes: int = 64 << 20  # the last bodies kept for warm-ups, in all


@dataclass(frozen=True)
class HintPolicy:
    tool_call: ToolCallPolicy = ToolCallPolicy()
    on_end: str = "free"
    idle_timeout_s: float = 600.0
    on_move: str = "share"
    move_wait_s: float = 10.0
    warmup: WarmupPolicy = WarmupPolicy()
    strategy: str = "auto"
    tick_s: float = 30.0
    watch_s: float = 600.0
    shadow_blocks: int = 65_536
    max_sessions: int = 100_000
    max_blocks: int = 1_000_000
    prior_gap_s: float = 120.0


@dataclass(frozen=True)
class RouterConfig:
    secret: bytes
    redis: RedisConfig
    workers: tuple[WorkerConfig, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    header_timeout_s: float = 75.0
    body_timeout_s: float = 30.0
    routing: RoutingConfig = RoutingConfig()
    policy: HintPolicy = HintPolicy()


def _known(section: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(known)})")


def _positive(value: Any, where: str, integer: bool = False) -> Any:
    """A positive number, finite and in range (``MAX_NUMBER``, ``MAX_INT``)."""
    kind = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not 0 < value <= (MAX_INT if integer else MAX_NUMBER)
    ):
        raise ValueError(
            f"{where} must be a positive {'integer' if integer else 'number'} "
            f"up to {MAX_INT if integer else MAX_NUMBER:g}, got {value!r}"
        )
    return value


def _whole_seconds(value: Any, where: str) -> Any:
    """A TTL Redis keeps in whole seconds: at least 1 (EXPIRE 0 deletes)."""
    if _positive(value, where) < 1:
        raise ValueError(f"{where} must be at least 1 (Redis keeps whole seconds), got {value!r}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value


def _choice(value: Any, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise ValueError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _section(doc: Mapping[str, Any], key: str, cls: type, spec: dict[str, Any]) -> Any:
    """``cls`` from ``doc[key]``: ``spec`` maps each field to its checker."""
    raw = mapping_of(doc.get(key), key)
    _known(raw, tuple(spec), key)
    return cls(**{k: spec[k](v, f"{key}.{k}") for k, v in raw.items()})


def _worker(raw: Any, i: int) -> WorkerConfig:
    where = f"workers[{i}]"
    raw = mapping_of(raw, where)
    _known(raw, ("name", "url", "control", "endpoint_file", "plain"), where)
    for key in ("name", "url"):
        if key not in raw:
            raise ValueError(f"{where}.{key} is required")
    url = _string(raw["url"], f"{where}.url").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}.url must be an http:// URL, got {url!r}")
    plain = _flag(raw.get("plain", False), f"{where}.plain")
    if plain and ("control" in raw or "endpoint_file" in raw):
        raise ValueError(f"{where}: a plain worker has no control channel")
    if not plain and ("control" in raw) == ("endpoint_file" in raw):
        raise ValueError(f"{where}: give control (tcp://host:port) or endpoint_file, one of them")
    bad = id_problem(raw["name"], f"{where}.name")  # it names the worker in headers
    if bad:
        raise ValueError(bad)
    return WorkerConfig(
        raw["name"],
        url,
        raw.get("control") and _string(raw["control"], f"{where}.control"),
        raw.get("endpoint_file") and _string(raw["endpoint_file"], f"{where}.endpoint_file"),
        plain,
    )


def _secret(path: Any) -> bytes:
    path = _string(path, "secret_file")
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"secret_file: cannot read {path!r}: {e.strerror}") from None
    if len(secret) < 16:
        raise ValueError("secret_file: the secret must be at least 16 bytes")
    return secret


def parse_config(doc: Any) -> RouterConfig:
    """``RouterConfig`` from a parsed YAML document (see the module docstring)."""
    doc = mapping_of(doc, "router config")
    _known(
        doc,
        ("version", "listen", "secret_file", "redis", "workers", "routing", "policy"),
        "router config",
    )
    if isinstance(doc.get("version", 1), bool) or doc.get("version", 1) != 1:
        raise ValueError(f"version must be 1, got {doc.get('version')!r}")
    if "secret_file" not in doc:
        raise ValueError("secret_file is required (the engines' trust.secret_file key)")
    listen = mapping_of(doc.get("listen"), "listen")
    _known(listen, ("host", "port", "header_timeout_s", "body_timeout_s"), "listen")
    host = _string(listen.get("host", "127.0.0.1"), "listen.host")
    port = listen.get("port", 8100)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"listen.port must be an integer in [0, 65535], got {port!r}")
    header_timeout_s = _positive(listen.get("header_timeout_s", 75.0), "listen.header_timeout_s")
    body_timeout_s = _positive(listen.get("body_timeout_s", 30.0), "listen.body_timeout_s")
    if "url" not in mapping_of(doc.get("redis"), "redis"):
        raise ValueError("redis.url is required (session state lives in Redis)")
    redis_cfg = _section(
        doc,
        "redis",
        RedisConfig,
        {
            "url": _string,
            "namespace": _string,
            "state_ttl_s": _whole_seconds,
            "timeout_s": _positive,
            "retry_s": _positive,
        },
    )
    workers = doc.get("workers")
    if not isinstance(workers, list) or not workers:
        raise ValueError("workers must be a non-empty list")
    parsed = tuple(_worker(w, i) for i, w in enumerate(workers))
    names = [w.name for w in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"workers: names must be unique, got {names}")
    routing = _section(
        doc,
        "routing",
        RoutingConfig,
        {
            "max_load": lambda v, w: _positive(v, w, integer=True),
            "load_poll_s": _positive,
            "request_timeout_s": _positive,
            "overlap": _flag,
            "overlap_g2_weight": _positive,
            "retry": _flag,
        },
    )
    policy_doc = mapping_of(doc.get("policy"), "policy")
    policy = _section(
        {"policy": {k: v for k, v in policy_doc.items() if k not in ("tool_call", "warmup")}},
        "policy",
        HintPolicy,
        {
            "tool_call": None,
            "warmup": None,
            "on_end": lambda v, w: _choice(v, END_ACTIONS, w),
            "idle_timeout_s": _positive,
            "on_move": lambda v, w: _choice(v, MOVE_ACTIONS, w),
            "move_wait_s": _positive,
            "strategy": lambda v, w: _choice(v, STRATEGIES, w),
            "tick_s": _positive,
            "watch_s": _positive,
            "shadow_blocks": lambda v, w: _positive(v, w, integer=True),
            "max_sessions": lambda v, w: _positive(v, w, integer=True),
            "max_blocks": lambda v, w: _positive(v, w, integer=True),
            "prior_gap_s": _positive,
        },
    )
    tool_call = _section(
        {"policy.tool_call": policy_doc.get("tool_call")},
        "policy.tool_call",
        ToolCallPolicy,
        {
            "pin": _flag,
            "expected_gap_s": _positive,
            "pin_ttl_factor": _positive,
            "max_pins_per_client": lambda v, w: _positive(v, w, integer=True),
        },
    )
    warmup = _section(
        {"policy.warmup": policy_doc.get("warmup")},
        "policy.warmup",
        WarmupPolicy,
        {
            "enabled": _flag,
            "lead_s": _positive,
            "max_bytes": lambda v, w: _positive(v, w, integer=True),
        },
    )
    policy = dataclasses.replace(policy, tool_call=tool_call, warmup=warmup)
    return RouterConfig(
        _secret(doc["secret_file"]),
        redis_cfg,
        parsed,
        host,
        port,
        header_timeout_s,
        body_timeout_s,
        routing,
        policy,
    )


def load_config(path: str) -> RouterConfig:
    """``RouterConfig`` from a YAML file."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = load_yaml(f)
    except OSError as e:
        raise ValueError(f"router config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"router config {path!r}: invalid YAML: {e}") from None
    except RecursionError:
        raise ValueError(f"router config {path!r}: YAML nested too deep") from None
    return parse_config(doc)
