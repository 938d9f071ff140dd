"""Public keys handed to `muser wal verify --pubkey FILE` (raw PEM bytes), by key id."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys

EXPECTED = (
    "expected an Ed25519 public key in PEM (-----BEGIN PUBLIC KEY-----), "
    "such as the .pub file `muser keygen` writes"
)


class PubkeyFile(bytes):
    """The bytes of one `--pubkey FILE` that remember the file they were read from, so a
    refusal can name it. Record interpreters receive them as the raw bytes they are."""

    path: Path

    def __new__(cls, data: bytes, path: str | PathLike[str]) -> PubkeyFile:
        self = super().__new__(cls, data)
        self.path = Path(path)
        return self


def keys_by_id(pems: Sequence[bytes]) -> dict[str, Ed25519PublicKey]:
    out = {}
    for pem in pems:
        path = getattr(pem, "path", None)
        where = "a --pubkey" if path is None else f"--pubkey {path}"
        try:
            key = keys.public_from_pem(pem, where)
        except keys.KeyFileError as exc:
            if isinstance(exc.__cause__, (ValueError, TypeError)):  # not a public key PEM
                raise keys.KeyFileError(f"{exc}; {EXPECTED}") from exc.__cause__
            raise
        out[keys.key_id(key)] = key
    return out
