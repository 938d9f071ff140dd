"""Ed25519 in `muser.keys`: libsodium signs and checks short messages, OpenSSL long ones
(module note); both give the same signatures, refuse the same forgeries, and a small-order
public key is refused where it is read."""

from __future__ import annotations

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import crypto_scalarmult_ed25519_base_noclamp

from muser import keys, walkeys

SIZES = [0, 300, keys.SODIUM_MAX_BYTES, keys.SODIUM_MAX_BYTES + 1, 100_000]
"""Both sides of the threshold, and a T = 1 request's size."""

IDENTITY = b"\x01" + b"\x00" * 31
"""The identity point: a small-order "public key"."""


def _message(size: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(size))


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


@pytest.mark.parametrize("size", SIZES)
def test_a_signer_signs_the_bytes_the_key_signs(key, size):
    message = _message(size)
    signature = keys.Signer(key).sign(message)
    assert signature == key.sign(message)
    key.public_key().verify(signature, message)  # OpenSSL takes it too


@pytest.mark.parametrize("size", SIZES)
def test_verify_takes_a_good_signature_and_refuses_any_change(key, size):
    public, message = key.public_key(), _message(size)
    signature = key.sign(message)
    keys.verify(public, message, signature, "a round")
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    other = Ed25519PrivateKey.from_private_bytes(bytes(32)).sign(message)
    changed = message[:-1] + bytes([message[-1] ^ 1]) if message else b"x"
    for sig, msg in ((flipped, message), (other, message), (signature, changed)):
        with pytest.raises(keys.SignatureError, match="a round: signature does not verify"):
            keys.verify(public, msg, sig, "a round")


@pytest.mark.parametrize("length", [0, 63, 65])
def test_a_signature_of_the_wrong_length_is_refused_by_name(key, length):
    with pytest.raises(keys.SignatureError, match=f"64 bytes, got {length}"):
        keys.verify(key.public_key(), b"m", b"\x00" * length, "a round")


@pytest.mark.parametrize(("size", "sodium"), [(300, True), (keys.SODIUM_MAX_BYTES + 1, False)])
def test_libsodium_does_the_short_messages(monkeypatch, key, size, sodium):
    """The threshold takes effect: libsodium is called for short messages only."""
    calls = []
    for name in ("crypto_sign", "crypto_sign_open"):
        real = getattr(keys, name)
        monkeypatch.setattr(keys, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    message = _message(size)
    signature = keys.Signer(key).sign(message)
    keys.verify(key.public_key(), message, signature, "a round")
    assert calls == (["crypto_sign", "crypto_sign_open"] if sodium else [])


def _small_order_forgery() -> bytes:
    """A "signature" that holds for every message under the identity key: R = [s]B, S = s."""
    s = (12345).to_bytes(32, "little")
    return crypto_scalarmult_ed25519_base_noclamp(s) + s


def test_a_forgery_under_a_small_order_key_is_refused():
    public, forged = Ed25519PublicKey.from_public_bytes(IDENTITY), _small_order_forgery()
    public.verify(forged, b"any message")  # OpenSSL takes it: what libsodium is there for
    with pytest.raises(InvalidSignature):
        public.verify(forged[:-1] + b"\x01", b"any message")
    with pytest.raises(keys.SignatureError, match="does not verify"):
        keys.verify(public, b"any message", forged, "a round")


@pytest.mark.parametrize("kind", ["not-pem", "rsa"])
def test_a_pubkey_that_is_no_ed25519_key_is_refused_by_name(tmp_path, kind):
    """The same refusals for a key file and for `wal verify --pubkey` bytes (a PEM that did
    not parse was a bare ValueError there: a traceback from `muser wal verify`)."""
    if kind == "not-pem":
        pem, says = b"not a key\n", "cannot load Ed25519 public key from {where}: Unable"
    else:
        other = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
        pem = other.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        says = "{where} holds a RSAPublicKey, expected an Ed25519 key"
    path = tmp_path / "other.pub"
    path.write_bytes(pem)
    with pytest.raises(keys.KeyFileError, match=says.format(where=path)):
        keys.load_public(path)
    with pytest.raises(keys.KeyFileError, match=says.format(where="a --pubkey")):
        walkeys.keys_by_id([pem])


def test_a_small_order_public_key_is_refused_where_it_is_read(tmp_path, key):
    pem = Ed25519PublicKey.from_public_bytes(IDENTITY).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path = tmp_path / "weak.pub"
    path.write_bytes(pem)
    with pytest.raises(keys.KeyFileError, match=f"{IDENTITY.hex()} is a small-order"):
        keys.load_public(path)
    with pytest.raises(keys.KeyFileError, match="a --pubkey: Ed25519 public key"):
        walkeys.keys_by_id([pem])
    good = tmp_path / "good.pub"
    keys.write_keypair(key, tmp_path / "good.key", good)
    assert keys.load_public(good).public_bytes_raw() == key.public_key().public_bytes_raw()
