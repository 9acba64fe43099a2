"""``sessionkv``: command line for an engine's control channel, and the router.

    sessionkv hint pin --endpoint tcp://127.0.0.1:5700 --secret-file router.key \\
        --session s1 --ttl 120
    sessionkv hint end-session --endpoint-file /run/engine-a.json --secret-file router.key \\
        --session s1
    sessionkv events --endpoint tcp://127.0.0.1:5700 --secret-file router.key --after 0
    sessionkv router --config router.yaml
    sessionkv status --engine tcp://127.0.0.1:5700 --secret-file router.key
    sessionkv doctor --engine tcp://10.0.0.5:5700 --engine tcp://10.0.0.6:5700 \
        --secret-file router.key           # see sessionkv.doctor

Outcomes and events are printed as JSON lines. Exit status: 0 when the hint
was accepted, clipped or deferred; 1 when rejected or missing; 2 when the
engine did not answer (or answered with another secret).
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from sessionkv.client import ControlError, HintClient
from sessionkv.events import KINDS
from sessionkv.hints import Action, Status

VERBS = [a.value for a in Action] + ["end-session"]


def _client(args: argparse.Namespace) -> HintClient:
    with open(args.secret_file, "rb") as f:
        secret = f.read().strip()
    kw = {"timeout_s": args.timeout}
    if args.endpoint_file:
        return HintClient.from_endpoint_file(args.endpoint_file, secret, **kw)
    return HintClient(args.endpoint, secret, **kw)


def _print(obj) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


def _hint(args: argparse.Namespace, client: HintClient) -> int:
    if args.verb == "end-session":
        outcome = client.end_session(args.session)
    else:
        target: dict[str, bytes | list[bytes]] = {}
        if args.keys:
            target["keys"] = [bytes.fromhex(k) for k in args.keys]
        for name in ("branch", "boundary"):
            if getattr(args, name):
                target[name] = bytes.fromhex(getattr(args, name))
        bounds = {
            k: v
            for k, v in (
                ("ttl_s", args.ttl),
                ("priority", args.priority),
                ("destination", args.destination),
                ("max_blocks", args.max_blocks),
            )
            if v is not None
        }
        if args.verb == "retain":
            bounds.setdefault("priority", 0)
        if args.verb == "share" and "destination" not in bounds:
            raise SystemExit("sessionkv hint share: --destination is required")
        outcome = getattr(client, args.verb)(args.session, **bounds, **target)
    _print(outcome)
    return 1 if outcome.status in (Status.REJECTED, Status.MISSING) else 0


def _events(args: argparse.Namespace, client: HintClient) -> int:
    for ev in client.subscribe(
        after=args.after, kinds=args.kinds, idle_timeout_s=args.idle_timeout
    ):
        _print(ev)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sessionkv", description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--endpoint",
        "--engine",
        dest="endpoint",
        help="the engine's control endpoint, tcp://host:port",
    )
    where.add_argument("--endpoint-file", help="the JSON file the engine wrote")
    common.add_argument("--secret-file", required=True, help="the shared secret (router key)")
    common.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    sub = p.add_subparsers(dest="command", required=True)

    h = sub.add_parser("hint", parents=[common], help="send one hint")
    h.add_argument("verb", choices=VERBS)
    h.add_argument("--session", required=True)
    h.add_argument("--ttl", type=float)
    h.add_argument("--priority", type=int)
    h.add_argument("--destination")
    h.add_argument("--max-blocks", type=int)
    h.add_argument("--branch", help="hex key: one branch of the session")
    h.add_argument("--boundary", help="hex key: the session's prefix up to this block")
    h.add_argument("--keys", nargs="+", help="hex keys: exact blocks instead of the session")

    e = sub.add_parser("events", parents=[common], help="print the event stream")
    e.add_argument("--after", type=int, help="replay kept events after this seq first")
    e.add_argument("--kinds", nargs="+", choices=KINDS)
    e.add_argument("--idle-timeout", type=float, help="stop after this many idle seconds")

    sub.add_parser(
        "status",
        parents=[common],
        help="sessions, pins, outcome counts and recent evictions (JSON)",
    )
    sub.add_parser(
        "doctor", add_help=False, help="why engines would not share KV (sessionkv doctor --help)"
    )

    r = sub.add_parser("router", help="run the reference router (sessionkv.router)")
    r.add_argument("--config", required=True, help="router.yaml")
    r.add_argument("--log-level", default="INFO")
    r.add_argument(
        "--admin-token",
        action="store_true",
        help="print the admin routes' bearer token (drain) and exit",
    )
    return p


def _router(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from sessionkv.router import load_config, serve

    try:
        cfg = load_config(args.config)
    except ValueError as e:
        print(f"sessionkv router: {e}", file=sys.stderr)
        return 2
    if args.admin_token:
        from sessionkv.router.auth import admin_token

        print(admin_token(cfg.secret))
        return 0
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    asyncio.run(
        serve(
            cfg,
            ready=lambda port: print(
                f"sessionkv router listening on http://{cfg.host}:{port}", flush=True
            ),
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # its own options (several engines)
        from sessionkv import doctor

        return doctor.main(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "router":
        return _router(args)
    try:
        with _client(args) as client:
            if args.command == "status":
                _print(client.status())
                return 0
            return (_hint if args.command == "hint" else _events)(args, client)
    except ControlError as e:
        print(f"sessionkv: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
