"""`muser keygen --tls` writes certificates that work: mutual TLS on a real grpc.aio server
succeeds, and a client without a certificate, or with one from another CA, is refused."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster_config.schema import TLS_ROLES, Tls
from muser import tls
from muser_app.cli.main import main

SERVING = health_pb2.HealthCheckResponse.SERVING


def tls_section(written: dict) -> Tls:
    """The [tls] section naming the files `write_tls` wrote."""
    return Tls.model_validate({"ca": written["ca"]["cert"], **{r: written[r] for r in TLS_ROLES}})


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Tls:
    return tls_section(tls.write_tls(tmp_path_factory.mktemp("ours"), ["verifier", "proposer"]))


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> Tls:
    """A complete set under another CA."""
    return tls_section(tls.write_tls(tmp_path_factory.mktemp("theirs"), ["verifier", "proposer"]))


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def test_keygen_tls_writes_a_ca_and_certificates(tmp_path, capsys):
    argv = ["keygen", "--out", str(tmp_path), "--tls", "--host", "gx10.lan", "--host", "10.1.2.3"]
    assert main([*argv, "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert set(written["tls"]) == {"ca", "verifier", "proposer", "client"}
    ca = cert(written["tls"]["ca"]["cert"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, files in written["tls"].items():
        assert stat.S_IMODE(Path(files["key"]).stat().st_mode) == 0o600, name
        if name == "ca":
            continue
        leaf = cert(files["cert"])
        assert tls.signed_by(leaf, ca), name
        usages = set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        if name == "client":
            assert usages == {ExtendedKeyUsageOID.CLIENT_AUTH}
            assert tls.subject_names(leaf) == set()
        else:
            assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
            names = {"127.0.0.1", "::1", "localhost", "gx10.lan", "10.1.2.3"}
            assert tls.subject_names(leaf) == names
    for name in ("verifier", "proposer"):  # the Ed25519 signing keys, as without --tls
        assert stat.S_IMODE((tmp_path / f"{name}.key").stat().st_mode) == 0o600


def test_keygen_refuses_before_writing_anything(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path), "--name", "a"]) == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["keygen", "--out", str(tmp_path), "--name", "a", "--tls"]) == 2
    assert "a.key exists; pass --force" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert main(["keygen", "--out", str(tmp_path / "x"), "--host", "gx10"]) == 2
    assert "add --tls" in capsys.readouterr().err
    assert main(["keygen", "--out", str(tmp_path / "y"), "--tls", "--name", "client"]) == 2


async def health_server(section: Tls | None, role: tls.Role = "verifier"):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = tls.add_port(server, "127.0.0.1:0", section, role)
    await server.start()
    await servicer.set("", SERVING)
    return server, f"127.0.0.1:{port}"


async def check(channel) -> int:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return reply.status


async def refused(channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await check(channel)
    return caught.value.code()


@pytest.mark.asyncio
@pytest.mark.parametrize(("server_role", "client_role"), [("verifier", "proposer"),
                                                          ("verifier", "client"),
                                                          ("proposer", "client")])  # fmt: skip
async def test_mutual_tls_succeeds(ours, server_role, client_role):
    server, address = await health_server(ours, server_role)
    try:
        assert await check(tls.open_channel(address, ours, client_role, aio=True)) == SERVING
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_client_without_a_certificate_is_refused(ours):
    server, address = await health_server(ours)
    try:
        anonymous = grpc.ssl_channel_credentials(root_certificates=ours.ca.read_bytes())
        channel = grpc.aio.secure_channel(address, anonymous)
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
        plaintext = tls.open_channel(address, None, "client", aio=True)
        assert await refused(plaintext) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_client_certificate_from_another_ca_is_refused(ours, theirs):
    server, address = await health_server(ours)
    try:
        stranger = grpc.ssl_channel_credentials(
            root_certificates=ours.ca.read_bytes(),  # it trusts our server...
            private_key=theirs.client.key.read_bytes(),  # ...but signs with another CA's cert
            certificate_chain=theirs.client.cert.read_bytes(),
        )
        channel = grpc.aio.secure_channel(address, stranger)
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_server_certificate_from_another_ca_is_refused(ours, theirs):
    server, address = await health_server(theirs)
    try:
        channel = tls.open_channel(address, ours, "client", aio=True)
        assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_without_tls_channels_are_insecure(ours):
    server, address = await health_server(None)
    try:
        assert await check(tls.open_channel(address, None, "client", aio=True)) == SERVING
        assert await refused(tls.open_channel(address, ours, "client", aio=True)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    finally:
        await server.stop(None)


def test_a_missing_tls_file_is_named_when_credentials_load(ours, tmp_path):
    broken = ours.model_copy(update={"ca": tmp_path / "absent.pem"})
    with pytest.raises(tls.TlsError, match=r"cannot read tls.ca .*absent.pem"):
        tls.channel_credentials(broken, "client")
