"""Ed25519 keys: each verifier signs results, each proposer signs requests (docs/design.md §7).

Private keys are PKCS#8 PEM written 0600; public keys SubjectPublicKeyInfo PEM. A key id is
the first 16 hex digits of SHA-256 over the raw 32-byte public key.

The key files are read and written with `cryptography`. Both daemons sign once and verify
once every round, so short messages are signed and checked with libsodium (PyNaCl), whose
curve arithmetic costs about half of the OpenSSL's that `cryptography` carries; its SHA-512
is slower, so past `SODIUM_MAX_BYTES` (a T = 1 request with its q rows is ~100 KB) OpenSSL
does it. On the project's test machine (µs, libsodium against OpenSSL): verify 113 / 236
at 300 bytes, 143 / 199 at 16 KB, 395 / 343 at 98 KB; sign 47 / 77, 119 / 115, 845 / 464.
Ed25519 signatures are deterministic (RFC 8032), so either gives the same bytes. Checks: a
signature must be 64 bytes; libsodium accepts a subset of what OpenSSL accepts (it also
refuses small-order keys and points, which no honest key or signature has); and a public key
is refused where it is read unless it is a point of the prime-order group (`check_point`),
so the OpenSSL path never meets a small-order key either.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from nacl.bindings import (
    crypto_core_ed25519_is_valid_point,
    crypto_sign,
    crypto_sign_open,
    crypto_sign_seed_keypair,
)
from nacl.exceptions import BadSignatureError

from muser.errors import RefusedError

SIGNATURE_BYTES = 64
SODIUM_MAX_BYTES = 16 * 1024
"""Messages up to this long are signed and checked with libsodium, longer ones with OpenSSL
(module note)."""


class SignatureError(RefusedError):
    """A signature does not verify under the named key."""


class KeyFileError(RefusedError):
    """A key file is missing, unreadable or not an Ed25519 key."""


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_private(key, path: Path) -> None:
    """A private key (Ed25519 or the TLS ECDSA ones) as PKCS#8 PEM, created 0600 and never
    widened."""
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)


def write_keypair(private: Ed25519PrivateKey, private_path: Path, public_path: Path) -> None:
    """Write the private key 0600 (created with that mode, never widened) and the public key."""
    write_private(private, private_path)
    public_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"cannot load Ed25519 private key from {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, expected an Ed25519 key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot load Ed25519 public key from {path}: {exc}") from exc
    return public_from_pem(pem, str(path))


def public_from_pem(pem: bytes, where: str) -> Ed25519PublicKey:
    """The Ed25519 public key PEM `pem` holds, read from `where` (named in refusals), and
    checked to be a key of some private key (`check_point`)."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"cannot load Ed25519 public key from {where}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{where} holds a {type(key).__name__}, expected an Ed25519 key")
    return check_point(key, where)


def check_point(public: Ed25519PublicKey, where: str) -> Ed25519PublicKey:
    """`public`, refused (KeyFileError) unless it is a point of the prime-order group: under
    a small-order key (the identity, say) OpenSSL accepts one signature for every message,
    and no Ed25519 key pair has one."""
    if not crypto_core_ed25519_is_valid_point(public.public_bytes_raw()):
        raise KeyFileError(
            f"{where}: Ed25519 public key {public.public_bytes_raw().hex()} is a small-order "
            "or malformed point, not a key of any private key; refused"
        )
    return public


class Signer:
    """An Ed25519 private key that signs short messages with libsodium (module note): what
    the daemons sign with every round. `sign` and `public_key` as on the key it wraps, with
    the same signatures."""

    def __init__(self, private: Ed25519PrivateKey):
        self.private = private
        _, self._secret = crypto_sign_seed_keypair(private.private_bytes_raw())

    def sign(self, message: bytes) -> bytes:
        if len(message) > SODIUM_MAX_BYTES:
            return self.private.sign(message)
        return crypto_sign(message, self._secret)[:SIGNATURE_BYTES]

    def public_key(self) -> Ed25519PublicKey:
        return self.private.public_key()


SigningKey = Ed25519PrivateKey | Signer
"""What signs rounds: the daemons hold a `Signer`; a bare key signs the same bytes."""


def verify(public: Ed25519PublicKey, message: bytes, signature: bytes, what: str) -> None:
    """Refuse (SignatureError, naming `what` and the key) unless `signature` is `public`'s
    over `message`."""
    if len(signature) != SIGNATURE_BYTES:
        raise SignatureError(
            f"{what}: a signature is {SIGNATURE_BYTES} bytes, got {len(signature)} "
            f"(key {key_id(public)})"
        )
    try:
        if len(message) > SODIUM_MAX_BYTES:
            public.verify(signature, message)
        else:
            crypto_sign_open(signature + message, public.public_bytes_raw())
    except (BadSignatureError, InvalidSignature) as exc:
        raise SignatureError(
            f"{what}: signature does not verify under key {key_id(public)}"
        ) from exc
