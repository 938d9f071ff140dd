"""The typed, strict schema of `cluster.toml`.

Every section refuses unknown keys; every error quotes the offending value and its path in
the file (`verifier.address: ...`). Relative paths are resolved against the file's folder.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from muser.errors import RefusedError


class ConfigError(RefusedError):
    """The cluster file is missing, unparsable, or violates the schema or a refusal rule."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_address(value: str | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return value


class VerifierNode(_Strict):
    address: str = Field(description="HOST:PORT proposers reach the verifier at.")
    bind: str | None = Field(
        None, description="HOST:PORT the verifier's server binds (default: address)."
    )
    key: Path = Field(description="The verifier's Ed25519 private key (PEM, 0600).")
    public_key: Path = Field(description="Its public key; proposers enrol it.")
    wal_dir: Path = Field(description="Commit WAL and fragment store directory.")
    target: Path = Field(description="Target checkpoint directory (Hugging Face format).")
    backend: Literal["torch"] = Field("torch", description="Target backend producing full rows.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Target weights dtype; rows are always float64 on the host."
    )
    device: str = Field("cpu", description="torch device for the target (cpu, cuda, cuda:1).")

    _addr = field_validator("address", "bind")(_check_address)

    @property
    def bind_address(self) -> str:
        return self.bind or self.address


class ProposerNode(_Strict):
    address: str = Field(description="HOST:PORT clients reach the proposer's gRPC server at.")
    bind: str | None = Field(
        None, description="HOST:PORT the proposer's server binds (default: address)."
    )
    key: Path = Field(description="The proposer's Ed25519 private key (signs round requests).")
    public_key: Path = Field(description="Its public key; verifiers enrol it.")
    wal_dir: Path = Field(description="Session journal directory (PREPARED/COMMITTED).")
    draft: Path = Field(description="Draft checkpoint directory (same tokenizer as the target).")
    backend: Literal["torch", "mlx"] = Field("torch", description="Draft backend.")
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="mlx device: auto picks Metal when available, else CPU."
    )

    _addr = field_validator("address", "bind")(_check_address)

    @property
    def bind_address(self) -> str:
        return self.bind or self.address


class Lane(_Strict):
    draft_len: int = Field(4, ge=0, le=64, description="Drafts per round D.")
    q_top_k: int = Field(32, ge=1, le=4096, description="Sparse draft row width.")
    capture_layers: list[int] = Field(
        default_factory=list, description="Target layers whose hidden rows results attach."
    )


class Enrolment(_Strict):
    verifiers: list[Path] = Field(description="Enrolled verifier public keys (PEM).")
    proposers: list[Path] = Field(description="Enrolled proposer public keys (PEM).")


class Limits(_Strict):
    max_sessions: int = Field(64, ge=1, description="Open sessions a verifier holds at once.")
    max_message_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest gRPC message either daemon accepts."
    )
    max_tokens: int = Field(4096, ge=1, description="Largest max_tokens a session may ask for.")


class ClusterConfig(_Strict):
    verifier: VerifierNode
    proposer: ProposerNode
    lane: Lane = Lane()
    enrolment: Enrolment
    limits: Limits = Limits()
    path: Path | None = Field(None, exclude=True, description="Where this file was read from.")


def _resolve(raw: dict, base: Path) -> dict:
    """Resolve relative paths of path-typed fields against the config file's folder."""
    out = {}
    for section, fields in raw.items():
        if not isinstance(fields, dict):
            out[section] = fields
            continue
        resolved = {}
        for key, value in fields.items():
            if key in {"key", "public_key", "wal_dir", "target", "draft"} and isinstance(
                value, str
            ):
                value = str((base / value).resolve()) if not Path(value).is_absolute() else value
            elif key in {"verifiers", "proposers"} and isinstance(value, list):
                value = [
                    str((base / v).resolve())
                    if isinstance(v, str) and not Path(v).is_absolute()
                    else v
                    for v in value
                ]
            resolved[key] = value
        out[section] = resolved
    return out


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        cfg = ClusterConfig.model_validate(_resolve(raw, path.parent.resolve()))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            got = err.get("input")
            problems.append(f"{where}: {err['msg']} (got {got!r})")
        raise ConfigError(f"{path}: " + "; ".join(problems)) from exc
    return cfg.model_copy(update={"path": path.resolve()})
