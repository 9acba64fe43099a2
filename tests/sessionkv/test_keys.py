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
    env, exp = {"actions": []}, 2_000_000_000
    msg = canonical(env) + b"\ns1\n" + str(exp).encode()
    raw = hmac.new(SECRET, msg, hashlib.sha256).hexdigest()
    now = exp - 100
    assert not verify(env, "s1", f"{exp}.{raw}", SECRET, now=now)  # the bare secret
    want = f"{exp}." + hmac.new(derive(SECRET, HINT_SIG), msg, hashlib.sha256).hexdigest()
    assert sign(env, "s1", SECRET, ttl_s=100, now=now) == want
    assert verify(env, "s1", want, SECRET, now=now)


def test_a_signature_expires_and_its_expiry_is_covered():
    env = {"actions": []}
    sig = sign(env, "s1", SECRET, ttl_s=300, now=1_000_000)
    assert verify(env, "s1", sig, SECRET, now=1_000_000 + 299)
    assert not verify(env, "s1", sig, SECRET, now=1_000_000 + 301)  # a replay, too late
    exp, tag = sig.split(".")
    assert not verify(env, "s1", f"{int(exp) + 600}.{tag}", SECRET, now=1_000_000)  # moved
    far = sign(env, "s1", SECRET, ttl_s=86400, now=1_000_000)
    assert not verify(env, "s1", far, SECRET, now=1_000_000)  # too far ahead
    for odd in ("", "12", ".ab", "²³.ab", "1" * 13 + ".ab", "x.ab"):
        assert not verify(env, "s1", odd, SECRET, now=1_000_000)


def test_control_frames_use_the_derived_key():
    payload = b"\x81\xa2op\xa5hello"
    raw = hmac.new(SECRET, wire.REQUEST_DOMAIN + payload, hashlib.sha256).digest()
    assert not wire.authentic(wire.REQUEST_DOMAIN, payload, raw, SECRET)
    assert wire.authentic(
        wire.REQUEST_DOMAIN, payload, wire.mac(wire.REQUEST_DOMAIN, payload, SECRET), SECRET
    )


@pytest.mark.parametrize("signature", ["é" * 64, "\ud800", "", "0" * 65])
def test_odd_signatures_are_refused_not_raised(signature):
    assert verify({"actions": []}, "s1", signature, SECRET) is False
