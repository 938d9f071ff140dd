"""`muser wal verify --pubkey FILE` and `--interpreter SPEC` given bad input: refused (exit 2)
with a message naming what was received and what was expected, no traceback, nothing
written. A built-in interpreter that cannot be imported stays a runtime error (exit 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from toy_rounds import ToyInterpreter

from muser.keys import KeyFileError
from wal import FileLog
from wal.interpret import register_interpreter

PROPOSER_INTERPRETER = "proposer_mac.journal:WalInterpreter"  # it reads every --pubkey


def a_log(directory: Path) -> Path:
    with FileLog(directory) as log:
        log.append(b"record 0")
    return directory


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


# --- --pubkey FILE that is not an Ed25519 public key ---------------------------------------


def private_pem() -> bytes:
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


@pytest.mark.parametrize(
    "name, content",
    [
        ("cluster.toml", b'[verifier]\naddress = "127.0.0.1:50051"\n'),
        ("verifier.key", private_pem()),  # the private half handed by mistake
    ],
)
def test_verify_names_a_pubkey_file_that_holds_no_public_key(tmp_path, run_cli, name, content):
    directory = a_log(tmp_path / "log")
    before = tree(directory)
    key_file = tmp_path / name
    key_file.write_bytes(content)
    code, out, err = run_cli(
        "verify", directory, "--pubkey", key_file, "--interpreter", PROPOSER_INTERPRETER
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"muser wal: cannot load Ed25519 public key from --pubkey {key_file}: ")
    assert "expected an Ed25519 public key in PEM (-----BEGIN PUBLIC KEY-----)" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert tree(directory) == before


def test_pubkey_bytes_reach_interpreters_as_the_raw_bytes_of_the_file(tmp_path):
    from muser.walkeys import PubkeyFile, keys_by_id

    named = PubkeyFile(b"raw key bytes", tmp_path / "k.pub")
    assert named == b"raw key bytes" and isinstance(named, bytes)
    assert named.path == tmp_path / "k.pub"
    with pytest.raises(
        KeyFileError, match=f"--pubkey {tmp_path / 'k.pub'}: .* expected an Ed25519"
    ):
        keys_by_id([named])


# --- --interpreter SPEC that cannot be loaded ----------------------------------------------


@pytest.mark.parametrize("action", ["inspect", "verify"])
@pytest.mark.parametrize(
    "spec, says",
    [
        ("nosuch.module", "cannot import record interpreter module 'nosuch.module': No module"),
        ("toy_rounds:Nothing", "module 'toy_rounds' has no attribute 'Nothing'"),
        ("", "cannot import record interpreter module '': Empty module name"),
        (".relative", "cannot import record interpreter module '.relative'"),
    ],
)
def test_an_interpreter_that_cannot_be_loaded_is_refused(tmp_path, run_cli, action, spec, says):
    register_interpreter(ToyInterpreter())
    directory = a_log(tmp_path / "log")
    before = tree(directory)
    code, out, err = run_cli(action, directory, "--interpreter", spec)
    assert (code, out) == (2, "")
    assert err.startswith(f"muser wal: --interpreter {spec!r}: {says}")
    assert err.endswith(
        "; expected MODULE or MODULE:ATTR naming an importable record interpreter "
        "(registered interpreters: toy-round)\n"
    )
    assert "Traceback" not in err
    assert tree(directory) == before


def test_a_class_that_needs_arguments_is_refused(tmp_path, run_cli):
    code, _, err = run_cli("inspect", a_log(tmp_path / "log"), "--interpreter", "wal:FileLog")
    assert code == 2
    assert err.startswith("muser wal: record interpreter 'wal:FileLog': class 'FileLog' cannot")
    assert "expected an interpreter instance or a zero-argument class" in err


def test_a_builtin_interpreter_that_cannot_be_imported_stays_a_runtime_error(
    tmp_path, run_cli, monkeypatch
):
    from muser_app.cli import wal as cli_wal

    monkeypatch.setattr(cli_wal, "DAEMON_INTERPRETERS", ("no_such_builtin_xyz:X",))
    code, _, err = run_cli("inspect", a_log(tmp_path / "log"))
    assert code == 3  # the installation is broken, not the operator's input
    assert "cannot import record interpreter module 'no_such_builtin_xyz'" in err
