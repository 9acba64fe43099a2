"""Who calls the router: clients by their API key, administrators by a token
derived from the cluster secret. No state, no I/O.

A client is its API key (``Authorization: Bearer <key>``, as OpenAI clients
send it), named by an HMAC of the key (``keys.ROUTER_CLIENT``): the key itself
is never stored. Clients without a key share one name, "". The admin routes
(drain) take ``admin_token``, derived from the secret (``keys.ROUTER_ADMIN``),
so only the secret's holders have it.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from sessionkv.keys import ROUTER_ADMIN, ROUTER_CLIENT, derive


def bearer(request: web.Request) -> str:
    """The token of the request's ``Authorization: Bearer``, "" without one."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def client_auth(request: web.Request) -> dict[str, str]:
    """The client's ``Authorization`` header, to forward to an engine."""
    auth = request.headers.get("Authorization")
    return {} if auth is None else {"Authorization": auth}


def client_of(secret: bytes, request: web.Request) -> str:
    """Who sends a request: a name for its API key, "" for clients without
    one (their sessions are shared among them)."""
    token = bearer(request)
    if not token:
        return ""
    name = hmac.new(derive(secret, ROUTER_CLIENT), token.encode("utf-8", "replace"), hashlib.sha256)
    return "k-" + name.hexdigest()[:32]


def admin_token(secret: bytes) -> str:
    """The bearer token of the router's admin routes (drain): derived from
    the cluster secret (``keys.ROUTER_ADMIN``), so only its holders have it."""
    return derive(secret, ROUTER_ADMIN).hex()


def is_admin(secret: bytes, request: web.Request) -> bool:
    """Whether the request carries the admin token (``admin_token``)."""
    return hmac.compare_digest(
        bearer(request).encode("utf-8", "replace"), admin_token(secret).encode()
    )
