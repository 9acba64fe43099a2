"""One cluster secret, one key per use: ``derive`` makes each purpose's key
from the secret (HMAC-SHA256 over a label), so a key that leaks from one use
says nothing of the secret or of the others.

Every key the project uses comes from here: the request hints' signatures
(``HINT_SIG``, ``sessionkv.hints``), the control channel's frames
(``CONTROL``, ``sessionkv.control``), the control channel's CURVE key pairs
(``CURVE_SERVER``, ``CURVE_CLIENT``), the router's client names
(``ROUTER_CLIENT``), the router's admin token (``ROUTER_ADMIN``) and the G3
objects' MAC (``G3_MAC``).
Every engine process that holds a G3 tier holds the G3 MAC key, so an engine
that leaks it gives away neither the hint signatures nor the control channel.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

G3_MAC = "g3-object-mac"  # keyed BLAKE3 over each G3 object's name and bytes
HINT_SIG = "hint-signature"  # HMAC-SHA256 over a request's hint envelope and session id
CONTROL = "control-frame"  # HMAC-SHA256 over each control channel frame
CURVE_SERVER = "curve-server"  # the engines' CURVE secret key (ZMQ socket authentication)
CURVE_CLIENT = "curve-client"  # the one CURVE secret key of every client holding the secret
ROUTER_CLIENT = "router-client"  # HMAC-SHA256 naming a router client by its API key (kept
# in Redis instead of the key itself)
ROUTER_ADMIN = "router-admin"  # the bearer token of the router's admin routes (drain)


# Each frame and hint derives its key again: a few secrets, so a small cache.
@functools.lru_cache(maxsize=64)
def derive(secret: bytes, purpose: str) -> bytes:
    """32 bytes for ``purpose`` from the cluster ``secret``."""
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("a key is derived from a non-empty secret")
    return hmac.new(secret, b"sessionkv/v1/" + purpose.encode(), hashlib.sha256).digest()
