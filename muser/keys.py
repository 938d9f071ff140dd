"""Ed25519 keys: each verifier signs results, each proposer signs requests (DESIGN.md §6).

Private keys are PKCS#8 PEM written 0600; public keys SubjectPublicKeyInfo PEM. A key id is
the first 16 hex digits of SHA-256 over the raw 32-byte public key.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from muser.errors import RefusedError


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
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise KeyFileError(f"cannot load Ed25519 public key from {path}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, expected an Ed25519 key")
    return key


def verify(public: Ed25519PublicKey, message: bytes, signature: bytes, what: str) -> None:
    try:
        public.verify(signature, message)
    except InvalidSignature as exc:
        raise SignatureError(
            f"{what}: signature does not verify under key {key_id(public)}"
        ) from exc
