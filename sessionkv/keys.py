"""One cluster secret, one key per use: ``derive`` makes each purpose's key
from the secret (HMAC-SHA256 over a label), so a key that leaks from one use
says nothing of the secret or of the others.

Every engine process that holds a G3 tier holds the G3 MAC key; the hint
signatures and the control channel keep using the secret itself today (both
ends would have to change together).
"""

from __future__ import annotations

import hashlib
import hmac

G3_MAC = "g3-object-mac"        # keyed BLAKE3 over each G3 object's name and bytes


def derive(secret: bytes, purpose: str) -> bytes:
    """32 bytes for ``purpose`` from the cluster ``secret``."""
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("a key is derived from a non-empty secret")
    return hmac.new(secret, b"sessionkv/v1/" + purpose.encode(), hashlib.sha256).digest()
