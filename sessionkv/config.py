"""Connector configuration, parsed once at start into frozen dataclasses.

sessionkv's own keys live in one sub-dict of vLLM's ``kv_connector_extra_config``::

    {"cpu_bytes_to_use": 1073741824,          # vLLM's keys pass through untouched
     "sessionkv": {"policy_file": "tiers.yaml",
                   "control": {"port": 5700, "endpoint_file": "/run/engine-a.json"}}}

The control channel runs when the policy names a secret (``trust.secret_file``):
it always authenticates. Its settings are per engine, so they live here, not in
the policy file engines share.

Every error is a ``ValueError`` whose message names the offending key, raised
while the engine starts, never later. Nothing here reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

SUBKEY = "sessionkv"

# G2 eviction policies the policy file may name: vLLM's built-ins, and "session"
# (sessionkv.tiers.g2.policy.SessionCachePolicy: LRU biased by Pin and Retain).
G2_EVICTION_POLICIES = ("lru", "arc", "session")


@dataclass(frozen=True)
class G2Policy:
    """Policy of the G2 tier (pinned host memory, vLLM's CPU primary tier)."""

    eviction: str = "session"  # un-hinted, it evicts exactly as vLLM's "lru"


@dataclass(frozen=True)
class G3Policy:
    """Policy of the G3 tiers (``secondary_tiers``)."""

    # true: every chunk stored in G2 is written down to G3 too (vLLM's cascade);
    # false: only what a hint or the policy sends down.
    write_through: bool = True


@dataclass(frozen=True)
class SessionPolicy:
    """Session lifecycle in the SessionPrefixIndex."""

    idle_timeout_s: float = 3600.0  # a session with no request for this long ends
    max_tombstones: int = 10_000  # ended sessions remembered (to tell "ended" from "unknown")
    # At shutdown (SIGTERM), live sessions are Demoted to G3 first; waits this
    # long at most for the copies (0: no drain).
    drain_timeout_s: float = 10.0


@dataclass(frozen=True)
class Limits:
    """Bounds on what hints may ask. Fractions are of G2's capacity."""

    max_ttl_s: float = 600.0  # longer TTLs are clipped to this
    max_blocks_per_hint: int = 65_536  # larger targets are clipped to this
    pin_fraction_session: float = 0.25  # of G2 one session's pins may hold
    pin_fraction_global: float = 0.5  # of G2 all pins together may hold
    hints_per_s_per_client: float = 100.0
    unsigned_pin_fraction: float = 0.0  # separate quota for unsigned Pins; 0 = refused
    # Of G2 that hint copies (Demote, Share, Prefetch) reserve at a time; larger
    # ones proceed in waves, so vLLM's stores still find chunks (at least 1 chunk).
    move_fraction: float = 0.25


@dataclass(frozen=True)
class Trust:
    """The router's shared secret (HMAC-SHA256 key), read from a file."""

    secret: bytes | None = field(default=None, repr=False)
    secret_file: str | None = None


REPORT_PER_TIER = ("signed", "all")


@dataclass(frozen=True)
class ReportPolicy:
    """What a response's report (``sessionkv.report``) tells the client.

    Per-tier counts, and the report's total ``cached_tokens``, say whether a
    cache held a prefix: on a shared G3 that tells a client whether someone on
    another engine sent that prefix. ``signed``: only requests the router
    signed get them; ``all``: every request (trusted clients only). vLLM's own
    ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``,
    off by default) counts the connector's loads too: leave it off for
    untrusted clients, or give each tenant its own ``cache_salt``."""

    per_tier: str = "signed"


# G3 tier types whose ``module_path`` the policy file's ``tiers.g3.tier`` may leave out.
G3_MODULES = {
    "MooncakeTier": "sessionkv.tiers.g3.backends.mooncake",
    "RedisTier": "sessionkv.tiers.g3.backends.redis",
    "LMCacheTier": "sessionkv.tiers.g3.backends.lmcache",
    "DiskTier": "sessionkv.tiers.g3.backends.disk",
}
# Where 0.1.0 kept them: a ``module_path`` naming one still finds the tier.
MOVED_MODULES = {f"sessionkv.tiers.{m.rpartition('.')[2]}": m for m in G3_MODULES.values()}


@dataclass(frozen=True)
class TierStack:
    """The policy file's ``tiers`` section: G2's size and the G3 tiers in
    order (vLLM's ``secondary_tiers`` entries), so that one file describes a
    cluster's stack. ``None``: not in the file (then ``--kv-transfer-config``
    gives it, as vLLM's keys ``cpu_bytes_to_use`` and ``secondary_tiers``)."""

    g2_bytes: int | None = None
    g3: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True)
class TierPolicy:
    """The YAML tier policy file, parsed. Defaults apply when no file is given."""

    g2: G2Policy = field(default_factory=G2Policy)
    g3: G3Policy = field(default_factory=G3Policy)
    sessions: SessionPolicy = field(default_factory=SessionPolicy)
    limits: Limits = field(default_factory=Limits)
    trust: Trust = field(default_factory=Trust)
    report: ReportPolicy = field(default_factory=ReportPolicy)
    tiers: TierStack = field(default_factory=TierStack)


@dataclass(frozen=True)
class ControlConfig:
    """Where the control channel listens (one engine, all its DP ranks).

    ``port`` 0: any free port for each socket. Otherwise DP rank r binds its
    request socket at ``port + 2r`` and its event stream at ``port + 2r + 1``.
    ``endpoint_file``: where each rank writes its endpoints as JSON (rank r > 0
    appends ``.dp<r>`` to the name), for clients to find a port chosen freely.
    """

    host: str = "127.0.0.1"
    port: int = 0
    endpoint_file: str | None = None


@dataclass(frozen=True)
class SessionKVConfig:
    """Everything sessionkv reads from ``kv_connector_extra_config``."""

    policy: TierPolicy = field(default_factory=TierPolicy)
    policy_file: str | None = None
    control: ControlConfig = field(default_factory=ControlConfig)
    # Per-engine options of the policy file's G3 tiers, by tier type (for
    # example Mooncake's local_hostname): merged into each tier of that type.
    tier_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _reject_unknown(section: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in known:
            raise ValueError(f"unknown key {where}{key!r}; supported keys: {', '.join(known)}")


def mapping_of(value: Any, where: str) -> Mapping[str, Any]:
    """A YAML section as a mapping (absent: empty); a clear error naming ``where`` else."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


MAX_NUMBER = 1e9  # seconds (31 years), rates, counts: finite and in range
MAX_INT = 1 << 50  # bytes (1 PiB), blocks


def _positive_number(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= MAX_NUMBER
    ):
        raise ValueError(f"{where} must be a positive number up to {MAX_NUMBER:g}, got {value!r}")
    return float(value)


def _seconds_or_zero(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    return _positive_number(value, where)


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{where} must be a fraction in [0, 1], got {value!r}")
    return float(value)


def _parse_limits(raw: Any, source: str) -> Limits:
    raw = mapping_of(raw, f"{source}: limits")
    d = Limits()
    kinds: dict[str, Callable[[Any, str], Any]] = {  # a float or an int per field
        "max_ttl_s": _positive_number,
        "max_blocks_per_hint": _positive_int,
        "pin_fraction_session": _fraction,
        "pin_fraction_global": _fraction,
        "hints_per_s_per_client": _positive_number,
        "unsigned_pin_fraction": _fraction,
        "move_fraction": _fraction,
    }
    _reject_unknown(raw, tuple(kinds), f"{source}: limits.")
    return Limits(
        **{
            k: check(raw.get(k, getattr(d, k)), f"{source}: limits.{k}")
            for k, check in kinds.items()
        }
    )


def _parse_trust(raw: Any, source: str) -> Trust:
    raw = mapping_of(raw, f"{source}: trust")
    _reject_unknown(raw, ("secret_file",), f"{source}: trust.")
    path = raw.get("secret_file")
    if path is None:
        return Trust()
    where = f"{source}: trust.secret_file"
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"{where}: no such file {path!r}")
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{where}: the secret must be at least 16 bytes")
    return Trust(secret=secret, secret_file=path)


def _positive_int(value: Any, where: str) -> int:
    # bool is an int subclass; "true" is never a size.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_INT:
        raise ValueError(f"{where} must be a positive integer up to 2**50, got {value!r}")
    return value


def parse_policy(doc: Any, source: str = "policy") -> TierPolicy:
    """Parse a tier policy document (the YAML file's content)."""
    doc = mapping_of(doc, source)
    _reject_unknown(
        doc,
        ("version", "g2", "g3", "sessions", "limits", "trust", "report", "tiers"),
        f"{source}: ",
    )
    version = doc.get("version", 1)
    if isinstance(version, bool) or version != 1:
        raise ValueError(f"{source}: version must be 1, got {version!r}")
    g2 = mapping_of(doc.get("g2"), f"{source}: g2")
    _reject_unknown(g2, ("eviction",), f"{source}: g2.")
    eviction = g2.get("eviction", G2Policy.eviction)
    if eviction not in G2_EVICTION_POLICIES:
        raise ValueError(
            f"{source}: g2.eviction must be one of {', '.join(G2_EVICTION_POLICIES)},"
            f" got {eviction!r}"
        )
    g3 = mapping_of(doc.get("g3"), f"{source}: g3")
    _reject_unknown(g3, ("write_through",), f"{source}: g3.")
    write_through = g3.get("write_through", G3Policy.write_through)
    if not isinstance(write_through, bool):
        raise ValueError(f"{source}: g3.write_through must be true or false, got {write_through!r}")
    sess = mapping_of(doc.get("sessions"), f"{source}: sessions")
    _reject_unknown(
        sess, ("idle_timeout_s", "max_tombstones", "drain_timeout_s"), f"{source}: sessions."
    )
    defaults = SessionPolicy()
    sessions = SessionPolicy(
        idle_timeout_s=_positive_number(
            sess.get("idle_timeout_s", defaults.idle_timeout_s),
            f"{source}: sessions.idle_timeout_s",
        ),
        max_tombstones=_positive_int(
            sess.get("max_tombstones", defaults.max_tombstones),
            f"{source}: sessions.max_tombstones",
        ),
        drain_timeout_s=_seconds_or_zero(
            sess.get("drain_timeout_s", defaults.drain_timeout_s),
            f"{source}: sessions.drain_timeout_s",
        ),
    )
    return TierPolicy(
        g2=G2Policy(eviction=eviction),
        g3=G3Policy(write_through=write_through),
        sessions=sessions,
        limits=_parse_limits(doc.get("limits"), source),
        trust=_parse_trust(doc.get("trust"), source),
        report=_parse_report(doc.get("report"), source),
        tiers=_parse_tiers(doc.get("tiers"), source),
    )


def _parse_tiers(raw: Any, source: str) -> TierStack:
    raw = mapping_of(raw, f"{source}: tiers")
    _reject_unknown(raw, ("g2_bytes", "g3"), f"{source}: tiers.")
    g2 = raw.get("g2_bytes")
    if g2 is not None:
        g2 = _positive_int(g2, f"{source}: tiers.g2_bytes")
    g3 = raw.get("g3")
    if g3 is None:
        return TierStack(g2_bytes=g2)
    if not isinstance(g3, list):
        raise ValueError(
            f"{source}: tiers.g3.tier must be a list of tier entries, got {type(g3).__name__}"
        )
    return TierStack(
        g2_bytes=g2,
        g3=tuple(_tier_entry(e, f"{source}: tiers.g3.tier[{i}]") for i, e in enumerate(g3)),
    )


def _tier_entry(raw: Any, where: str) -> Mapping[str, Any]:
    """One G3 tier (its own keys are checked by the tier when the engine builds it)."""
    raw = mapping_of(raw, where)
    if not raw:
        raise ValueError(f"{where} is empty: it needs at least a type")
    for key in raw:
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be strings, got {key!r}")
    kind = raw.get("type")
    if not isinstance(kind, str) or not kind:
        raise ValueError(
            f"{where}.type must name a tier ({', '.join(G3_MODULES)} or a "
            f"vLLM secondary tier with module_path), got {kind!r}"
        )
    module = raw.get("module_path", G3_MODULES.get(kind))
    if not isinstance(module, str) or not module:
        raise ValueError(f"{where}.module_path is required for tier type {kind!r}")
    return {**raw, "module_path": MOVED_MODULES.get(module, module)}


def _parse_report(raw: Any, source: str) -> ReportPolicy:
    raw = mapping_of(raw, f"{source}: report")
    _reject_unknown(raw, ("per_tier",), f"{source}: report.")
    per_tier = raw.get("per_tier", ReportPolicy.per_tier)
    if per_tier not in REPORT_PER_TIER:
        raise ValueError(
            f"{source}: report.per_tier must be one of "
            f"{', '.join(REPORT_PER_TIER)}, got {per_tier!r}"
        )
    return ReportPolicy(per_tier=per_tier)


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases: 350 bytes of nested ``*refs``
    (a "billion laughs") cost a parser that walks the document gigabytes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed here", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def load_yaml(stream: Any) -> Any:
    """A sessionkv YAML file's document (``yaml.safe_load`` without aliases);
    raises ``yaml.YAMLError`` or ``RecursionError``."""
    return yaml.load(stream, Loader=_Loader)


def load_policy_file(path: str) -> TierPolicy:
    """Read and parse a YAML tier policy file."""
    if not os.path.isfile(path):
        raise ValueError(f"{SUBKEY}.policy_file: no such file {path!r}")
    with open(path, encoding="utf-8") as f:
        try:
            doc = load_yaml(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{SUBKEY}.policy_file {path!r}: invalid YAML: {e}") from e
        except RecursionError:
            raise ValueError(f"{SUBKEY}.policy_file {path!r}: YAML nested too deep") from None
    return parse_policy(doc, source=path)


def parse_extra_config(extra_config: Mapping[str, Any]) -> SessionKVConfig:
    """Validate vLLM's ``kv_connector_extra_config`` and parse our sub-dict.

    vLLM's keys are left to vLLM, except the sizes that vLLM itself reports
    poorly (``cpu_bytes_to_use``, ``block_size``, ``blocks_per_chunk``),
    ``eviction_policy``, which the policy file owns, and the tier stack, which
    either the policy file (``tiers``) or this dict gives, never both.
    """
    ours = mapping_of(extra_config.get(SUBKEY), SUBKEY)
    _reject_unknown(ours, ("policy_file", "control", "tier_options"), f"{SUBKEY}.")
    control = _parse_control(ours.get("control"))
    policy, policy_file = TierPolicy(), ours.get("policy_file")
    if policy_file is not None:
        if not isinstance(policy_file, str) or not policy_file:
            raise ValueError(f"{SUBKEY}.policy_file must be a path, got {policy_file!r}")
        policy = load_policy_file(policy_file)
    cfg = SessionKVConfig(
        policy=policy,
        policy_file=policy_file,
        control=control,
        tier_options=_parse_tier_options(ours.get("tier_options"), policy.tiers.g3),
    )
    _check_vllm_keys(extra_config, cfg)
    return cfg


def _check_vllm_keys(extra_config: Mapping[str, Any], cfg: SessionKVConfig) -> None:
    stack, where = cfg.policy.tiers, f"the policy file {cfg.policy_file!r}"
    if stack.g2_bytes is not None and "cpu_bytes_to_use" in extra_config:
        raise ValueError(
            f"cpu_bytes_to_use and tiers.g2_bytes in {where} both give G2's size: keep one"
        )
    if stack.g3 is not None and "secondary_tiers" in extra_config:
        raise ValueError(
            f"secondary_tiers and tiers.g3.tier in {where} both give the G3 tiers: keep one"
        )
    if "cpu_bytes_to_use" not in extra_config and stack.g2_bytes is None:
        raise ValueError(
            "cpu_bytes_to_use is required in kv_connector_extra_config (bytes of "
            "pinned host memory for G2), unless the policy file gives tiers.g2_bytes"
        )
    if "cpu_bytes_to_use" in extra_config:
        _positive_int(extra_config["cpu_bytes_to_use"], "cpu_bytes_to_use")
    for key in ("block_size", "blocks_per_chunk"):
        if key in extra_config:
            _positive_int(extra_config[key], key)
    for key in ("eviction_policy", "cache_policy_module_path"):
        if key in extra_config:
            raise ValueError(
                f"{key} is owned by sessionkv: set g2.eviction in the policy file "
                f"({SUBKEY}.policy_file) instead"
            )


def _parse_tier_options(
    raw: Any,
    tiers: tuple[Mapping[str, Any], ...] | None,
) -> Mapping[str, Mapping[str, Any]]:
    where = f"{SUBKEY}.tier_options"
    raw = mapping_of(raw, where)
    if not raw:
        return {}
    if tiers is None:
        raise ValueError(
            f"{where} sets options of the policy file's tiers.g3.tier, which has none "
            f"(give them in the secondary_tiers entries instead)"
        )
    out = {}
    for kind, options in raw.items():
        options = mapping_of(options, f"{where}.{kind}")
        mine = [t for t in tiers if t["type"] == kind]
        if not mine:
            raise ValueError(
                f"{where}.{kind}: no tier of that type in the policy file's "
                f"tiers.g3.tier ({', '.join(t['type'] for t in tiers)})"
            )
        for key in options:
            if key in ("type", "module_path") or any(key in t for t in mine):
                raise ValueError(
                    f"{where}.{kind}.{key} is set in the policy file's tiers.g3.tier too: keep one"
                )
        out[kind] = dict(options)
    return out


def vllm_extra_config(extra_config: Mapping[str, Any], cfg: SessionKVConfig) -> dict[str, Any]:
    """``kv_connector_extra_config`` as vLLM's tiering spec reads it: with the
    policy file's tier stack (and this engine's ``tier_options``) filled in."""
    out = dict(extra_config)
    stack = cfg.policy.tiers
    if stack.g2_bytes is not None:
        out["cpu_bytes_to_use"] = stack.g2_bytes
    if stack.g3 is not None:
        out["secondary_tiers"] = [
            {**entry, **cfg.tier_options.get(entry["type"], {})} for entry in stack.g3
        ]
    elif isinstance(tiers := out.get("secondary_tiers"), list):
        out["secondary_tiers"] = [
            {**t, "module_path": MOVED_MODULES[t["module_path"]]}
            if isinstance(t, dict) and t.get("module_path") in MOVED_MODULES
            else t
            for t in tiers
        ]
    return out


def _parse_control(raw: Any) -> ControlConfig:
    where = f"{SUBKEY}.control"
    raw = mapping_of(raw, where)
    _reject_unknown(raw, ("host", "port", "endpoint_file"), f"{where}.")
    host = raw.get("host", ControlConfig.host)
    if not isinstance(host, str) or not host:
        raise ValueError(f"{where}.host must be a host name or address, got {host!r}")
    port = raw.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65534:
        raise ValueError(f"{where}.port must be an integer in [0, 65534], got {port!r}")
    path = raw.get("endpoint_file")
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"{where}.endpoint_file must be a path, got {path!r}")
    return ControlConfig(host=host, port=port, endpoint_file=path)
