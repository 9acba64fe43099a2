"""One cluster secret, one key per use (``sessionkv.keys``): hint signatures,
control frames and G3 objects are each keyed by a key derived from the
secret, never by the secret itself."""

import hashlib
import hmac

import pytest

from sessionkv import control as wire
from sessionkv.hints import canonical, sign, verify
from sessionkv.keys import CONTROL, G3_MAC, HINT_SIG, derive

SECRET = b"cluster-secret-0123456789"


def test_each_use_has_its_own_key_and_none_is_the_secret():
    keys = {derive(SECRET, p) for p in (CONTROL, G3_MAC, HINT_SIG)}
    assert len(keys) == 3 and SECRET not in keys
    assert derive(SECRET, CONTROL) != derive(b"another-secret-0123", CONTROL)
    with pytest.raises(ValueError):
        derive(b"", CONTROL)


def test_hint_signatures_use_the_derived_key():
    env, msg_tail = {"actions": []}, b"\ns1"
    raw = hmac.new(SECRET, canonical(env) + msg_tail, hashlib.sha256).hexdigest()
    assert not verify(env, "s1", raw, SECRET)              # signed with the bare secret
    want = hmac.new(derive(SECRET, HINT_SIG), canonical(env) + msg_tail,
                    hashlib.sha256).hexdigest()
    assert sign(env, "s1", SECRET) == want and verify(env, "s1", want, SECRET)


def test_control_frames_use_the_derived_key():
    payload = b"\x81\xa2op\xa5hello"
    raw = hmac.new(SECRET, wire.REQUEST_DOMAIN + payload, hashlib.sha256).digest()
    assert not wire.authentic(wire.REQUEST_DOMAIN, payload, raw, SECRET)
    assert wire.authentic(wire.REQUEST_DOMAIN, payload,
                          wire.mac(wire.REQUEST_DOMAIN, payload, SECRET), SECRET)


@pytest.mark.parametrize("signature", ["é" * 64, "\ud800", "", "0" * 65])
def test_odd_signatures_are_refused_not_raised(signature):
    assert verify({"actions": []}, "s1", signature, SECRET) is False
