"""Refusals that used to pass: two servers of one machine on one port where one binds a
wildcard host (0.0.0.0, [::]) that takes the port on every interface, and a negative
`muser status --wait`. Exit 2, a message naming what was received and what was expected."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config.rules import distinct_addresses
from muser_app.cli.config import init_cluster, to_toml
from muser_app.cli.main import main


@pytest.fixture
def cluster_file(tmp_path, tiny_pair) -> Path:
    """A loopback cluster (`config init`): both daemons on 127.0.0.1, four distinct ports."""
    return init_cluster(tmp_path / "c", target=tiny_pair[0], draft=tiny_pair[1])


def set_values(path: Path, **values: str) -> None:
    """Set `role__key=value` entries (verifier__bind="0.0.0.0:1") of the cluster file."""
    data = tomllib.loads(path.read_text())
    for dotted, value in values.items():
        role, key = dotted.split("__")
        data[role][key] = value
    path.write_text(to_toml(data))


def port(address: str) -> str:
    return address.rpartition(":")[2]


def check(path: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["config", "check", str(path)])
    return code, capsys.readouterr().err


# --- a wildcard bind clashes with any host on its port, on one machine ----------------------


@pytest.mark.parametrize(
    "field, host, taken_from",
    [
        ("verifier.bind", "0.0.0.0", "proposer.address"),  # the reviewer's case
        ("verifier.bind", "[::]", "proposer.address"),
        ("verifier.bind", "[]", "proposer.address"),
        ("proposer.bind", "0.0.0.0", "verifier.address"),
        ("verifier.http", "0.0.0.0", "proposer.http"),
        ("proposer.http", "[::]", "verifier.address"),
        ("proposer.bind", "0.0.0.0", "proposer.http"),  # one node: its gRPC and HTTP servers
        ("verifier.http", "0.0.0.0", "verifier.address"),
    ],
)
def test_a_wildcard_host_clashes_with_any_host_on_its_port(
    cluster_file, unqualified, capsys, field, host, taken_from
):
    cfg = load_config(cluster_file)
    role, key = taken_from.split(".")
    taken = getattr(getattr(cfg, role), key)
    wildcard = f"{host}:{port(taken)}"
    set_values(cluster_file, **{field.replace(".", "__"): wildcard})
    code, err = check(cluster_file, capsys)
    assert code == 2
    assert f"{field} {wildcard!r}" in err and f"{taken_from} {taken!r}" in err
    assert f"both use port {port(taken)} on one machine: {field} binds it on every" in err
    assert "give each server its own HOST:PORT" in err
    assert "Traceback" not in err


def test_a_wildcard_bind_clashes_with_a_localhost_bind_of_the_other_node(
    cluster_file, unqualified, capsys
):
    set_values(cluster_file, verifier__bind="0.0.0.0:50051", proposer__bind="localhost:50051")
    code, err = check(cluster_file, capsys)
    assert code == 2
    assert "verifier.bind '0.0.0.0:50051' and proposer.bind 'localhost:50051' both use port" in err


def test_a_wildcard_bind_on_the_servers_own_port_passes(cluster_file, unqualified, capsys):
    address = load_config(cluster_file).verifier.address
    set_values(cluster_file, verifier__bind=f"0.0.0.0:{port(address)}")
    assert check(cluster_file, capsys) == (0, "")


# --- two machines keep what they had ---------------------------------------------------------


def two_machines(cluster_file: Path, **more: str) -> None:
    """The verifier at 10.0.0.5, the proposer at 10.0.0.6, both on port 50051."""
    set_values(
        cluster_file, verifier__address="10.0.0.5:50051", proposer__address="10.0.0.6:50051", **more
    )


def test_two_machines_may_use_one_port(cluster_file):
    two_machines(cluster_file)
    distinct_addresses(load_config(cluster_file), frozenset())
    two_machines(cluster_file, verifier__bind="0.0.0.0:50051")  # every interface of its own
    distinct_addresses(load_config(cluster_file), frozenset())
    two_machines(cluster_file, verifier__bind="0.0.0.0:50051", proposer__bind="[::]:50051")
    distinct_addresses(load_config(cluster_file), frozenset())


def test_a_wildcard_still_clashes_within_one_of_two_machines(cluster_file, unqualified, capsys):
    two_machines(cluster_file, verifier__bind="0.0.0.0:50051", verifier__http="127.0.0.1:50051")
    code, err = check(cluster_file, capsys)
    assert code == 2
    assert "verifier.bind '0.0.0.0:50051' and verifier.http '127.0.0.1:50051'" in err


def test_a_loopback_verifier_address_puts_both_nodes_on_one_machine(
    cluster_file, unqualified, capsys
):
    # the proposer dials the verifier at 127.0.0.1, so it runs where the verifier does
    set_values(
        cluster_file,
        verifier__address="127.0.0.1:50051",
        verifier__bind="0.0.0.0:50051",
        proposer__address="10.0.0.6:50052",
        proposer__http="10.0.0.6:50051",
    )
    code, err = check(cluster_file, capsys)
    assert code == 2
    assert "verifier.bind '0.0.0.0:50051' and proposer.http '10.0.0.6:50051'" in err


# --- muser status --wait ---------------------------------------------------------------------


@pytest.mark.parametrize("wait", ["-5", "-0.5", "nan", "soon"])
def test_status_refuses_a_wait_that_is_no_number_of_seconds(
    cluster_file, monkeypatch, capsys, wait
):
    import muser_app.cli.status

    def no_probe(*args, **kwargs):
        raise AssertionError("status probed a daemon under a --wait it should have refused")

    monkeypatch.setattr(muser_app.cli.status, "probe", no_probe)
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--config", str(cluster_file), "--wait", wait])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --wait: expected a number of seconds >= 0, got {wait!r}" in err


def test_status_accepts_a_zero_wait(cluster_file, monkeypatch, capsys):
    import muser_app.cli.status

    seen = []
    monkeypatch.setattr(
        muser_app.cli.status,
        "probe",
        lambda address, service, tls=None: (
            seen.append(service) or {"address": address, "serving": False}
        ),
    )
    assert main(["status", "--config", str(cluster_file), "--wait", "0"]) == 1
    assert seen == ["verifier", "proposer"]
