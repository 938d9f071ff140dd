"""Transport TLS for every gRPC channel to a daemon (docs/design.md §7).

Mutual TLS under one cluster CA (the `[tls]` section of cluster.toml):

    verifier server   presents tls.verifier, requires a client certificate signed by tls.ca
    proposer server   presents tls.proposer, requires a client certificate signed by tls.ca
    proposer → verifier   presents tls.proposer, checks the verifier's against tls.ca
    CLI → either      presents tls.client (`muser status`, `muser generate --lane cluster`)

The HTTP endpoints (the proposer's OpenAI-compatible API, both daemons' /metrics) serve
HTTPS with the node's certificate under `[tls]` (`http_ssl_context`), server-authenticated
only: HTTP clients (OpenAI SDKs, Prometheus) trust tls.ca and present no certificate.

Without a `[tls]` section every channel is insecure, as a loopback cluster needs. Every
server port and every channel to a daemon goes through `add_port` / `open_channel`, so the
two cases cannot drift apart.

Certificates are ECDSA P-256 (what gRPC's BoringSSL accepts on every platform), written by
`muser keygen --tls`: one self-signed CA, then per node a leaf with serverAuth and clientAuth
and subject alternative names for 127.0.0.1, ::1, localhost and every `--host`; the `client`
leaf has clientAuth only. Private keys are PKCS#8 PEM written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from muser.errors import RefusedError
from muser.keys import write_private

if TYPE_CHECKING:
    import grpc

Role = Literal["verifier", "proposer", "client"]


class CertFiles(Protocol):
    """A certificate and its private key (the config's `[tls.ROLE]`)."""

    cert: Path
    key: Path


class Tls(Protocol):
    """What the credentials read of the cluster file's `[tls]` section
    (`cluster_config.schema.Tls` is one); the core names no config type."""

    ca: Path

    def pair(self, role: Role) -> CertFiles: ...


LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
CLIENT = "client"


class TlsError(RefusedError):
    """A TLS file is missing, unreadable, or does not fit the rest of the [tls] section."""


# --- credentials --------------------------------------------------------------------------


def read_pem(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def server_credentials(tls: Tls, role: Role) -> grpc.ServerCredentials:
    """Present `role`'s certificate; require a client certificate signed by the CA."""
    import grpc

    pair = tls.pair(role)
    return grpc.ssl_server_credentials(
        [(read_pem(pair.key, f"tls.{role}.key"), read_pem(pair.cert, f"tls.{role}.cert"))],
        root_certificates=read_pem(tls.ca, "tls.ca"),
        require_client_auth=True,
    )


def channel_credentials(tls: Tls, role: Role) -> grpc.ChannelCredentials:
    """Check the server's certificate against the CA; present `role`'s certificate."""
    import grpc

    pair = tls.pair(role)
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca, "tls.ca"),
        private_key=read_pem(pair.key, f"tls.{role}.key"),
        certificate_chain=read_pem(pair.cert, f"tls.{role}.cert"),
    )


def add_port(server, address: str, tls: Tls | None, role: Role) -> int:
    """Bind `server` (grpc or grpc.aio) at `address`: TLS when configured; the bound port."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls, role))


def open_channel(
    address: str,
    tls: Tls | None,
    role: Role,
    *,
    options: Sequence[tuple[str, object]] = (),
    aio: bool = False,
):
    """A channel to the daemon at `address`, presenting `role`'s certificate under TLS."""
    import grpc

    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(address, options=list(options))
    return module.secure_channel(address, channel_credentials(tls, role), options=list(options))


def http_ssl_context(tls: Tls | None, role: Role):
    """The HTTPS context of `role`'s HTTP endpoints under `[tls]` (None: plain HTTP)."""
    if tls is None:
        return None
    import ssl

    pair = tls.pair(role)
    read_pem(pair.cert, f"tls.{role}.cert"), read_pem(pair.key, f"tls.{role}.key")  # named errors
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(pair.cert, pair.key)
    except (ssl.SSLError, ValueError) as exc:
        raise TlsError(f"tls.{role}: cannot load {pair.cert} with {pair.key}: {exc}") from exc
    return context


# --- inspection (the refusal rules) ---------------------------------------------------------


def load_cert(path: Path, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(read_pem(path, what))
    except ValueError as exc:
        raise TlsError(f"{what} {path} is not a PEM certificate: {exc}") from exc


def load_key(path: Path, what: str):
    try:
        return serialization.load_pem_private_key(read_pem(path, what), password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"{what} {path} is not an unencrypted PEM private key: {exc}") from exc


def public_der(key) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Issuer name and signature both match `ca` (unsupported key types count as no)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def subject_names(cert: x509.Certificate) -> set[str]:
    """DNS names and IP addresses the certificate is valid for (lower case)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    names = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    return names | {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def host_of(address: str) -> str:
    """The host of HOST:PORT, without IPv6 brackets, normalised as a SAN would spell it."""
    host = address.rpartition(":")[0].strip("[]").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


# --- generation (`muser keygen --tls`) ------------------------------------------------------


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "muser-cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int):
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(days: int = 3650) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    name = _name("muser-cluster CA")
    cert = (
        _builder(name, name, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys([*LOOPBACK_NAMES, *hosts]):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    name: str,
    hosts: Sequence[str] = (),
    *,
    server: bool = True,
    days: int = 3650,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf for `name`: clientAuth always, serverAuth and SANs when `server`."""
    key = _new_key()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = _builder(_name(name), ca_cert.subject, key.public_key(), days)
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write_cert(cert: x509.Certificate, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def private_paths(out: Path, names: Sequence[str]) -> list[Path]:
    """The private keys `write_tls(out, names)` writes (the CA's first)."""
    return [out / "ca.key"] + [out / f"{n}.key" for n in dict.fromkeys([*names, CLIENT])]


def write_tls(
    out: Path, names: Sequence[str], hosts: Sequence[str] = (), *, force: bool = False
) -> dict[str, dict[str, str]]:
    """A CA in `out` plus a cert/key per name and one `client` leaf; returns the paths."""
    leaves = [*dict.fromkeys([*names, CLIENT])]
    taken = [p for p in private_paths(out, names) if p.exists()]
    if taken and not force:
        raise TlsError(f"{taken[0]} exists; pass --force to overwrite it")
    ca_key, ca_cert = make_ca()
    write_private(ca_key, out / "ca.key")
    write_cert(ca_cert, out / "ca.pem")
    written = {"ca": {"cert": str(out / "ca.pem"), "key": str(out / "ca.key")}}
    for name in leaves:
        key, cert = issue(ca_key, ca_cert, name, hosts, server=name != CLIENT)
        write_private(key, out / f"{name}.key")
        write_cert(cert, out / f"{name}.pem")
        written[name] = {"cert": str(out / f"{name}.pem"), "key": str(out / f"{name}.key")}
    return written
