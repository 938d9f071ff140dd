"""`muser wal inspect|verify|repair` through the real CLI dispatcher (`run_cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from toy_rounds import GENESIS, ToyInterpreter, make_round

from wal import FileLog, Snapshot
from wal.interpret import register_interpreter, registered_interpreters, unregister_interpreter
from wal.segment import encode_segment_header

SEG1 = "seg-00000000000000000001.wal"


@pytest.fixture(autouse=True)
def clean_registry():
    before = registered_interpreters()
    yield
    for interpreter in registered_interpreters():
        if interpreter not in before:
            unregister_interpreter(interpreter)


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def plain_log(directory: Path) -> Path:
    with FileLog(directory, segment_bytes=100) as log:
        for i in range(5):
            log.append(b"payload %d" % i)  # 29 bytes per record: 3 per segment
    return directory


def round_log(directory: Path, key: Ed25519PrivateKey, tamper: int | None = None) -> Path:
    heads = {"s1": GENESIS, "s2": GENESIS}
    with FileLog(directory) as log:
        for i, session in enumerate(["s1", "s2", "s1", "s1", "s2"]):
            payload, head = make_round(session, i, heads[session], key)
            if i == tamper:
                payload, _ = make_round(session, i, GENESIS, key)
            heads[session] = head
            log.append(payload)
        log.append(b"not a round record")
    return directory


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_inspect_json_is_one_object_describing_the_log(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    code, out, err = run_cli("inspect", directory, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == {
        "directory": str(directory),
        "segments": [
            {
                "file": SEG1,
                "first_seq": 1,
                "last_seq": 3,
                "records": 3,
                "bytes": 111,
                "status": "ok",
            },
            {
                "file": "seg-00000000000000000004.wal",
                "first_seq": 4,
                "last_seq": 5,
                "records": 2,
                "bytes": 82,
                "status": "ok",
            },
        ],
        "snapshots": [],
        "records": 5,
        "first_seq": 1,
        "last_seq": 5,
        "latest_snapshot_seq": None,
        "torn_tail": None,
        "corruption": None,
        "interpreters": [],
        "sessions": {},
    }


def test_inspect_text_names_files_ranges_and_the_torn_tail(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    with (directory / "seg-00000000000000000004.wal").open("ab") as handle:
        handle.write(b"\xa5WR\x5a\x00")
    code, out, _ = run_cli("inspect", directory)
    assert code == 0
    assert out.splitlines() == [
        f"{directory}:",
        f"  {SEG1}  seq 1..3  3 records  111 bytes  ok",
        "  seg-00000000000000000004.wal  seq 4..5  2 records  87 bytes  torn tail at byte "
        "offset 82: partial record header (5 of 20 bytes)",
        "records: 5 (seq 1..5)",
        "torn tail: seg-00000000000000000004.wal at byte offset 82 (partial record header "
        "(5 of 20 bytes)); open truncates it",
        "sessions: unknown (no record interpreter registered)",
    ]


def test_inspect_reports_sessions_and_heads_through_an_interpreter(tmp_path, run_cli, key):
    directory = round_log(tmp_path / "log", key)
    code, out, _ = run_cli(
        "inspect", directory, "--json", "--interpreter", "toy_rounds:ToyInterpreter"
    )
    assert code == 0
    report = json.loads(out)
    heads = {}
    for session in ("s1", "s2"):
        head = GENESIS
        for i, s in enumerate(["s1", "s2", "s1", "s1", "s2"]):
            if s == session:
                _, head = make_round(s, i, head, key)
        heads[session] = head
    assert report["interpreters"] == ["toy-round"]
    assert report["sessions"] == {
        "s1": {"rounds": 3, "last_round": 3, "head": heads["s1"], "last_seq": 4},
        "s2": {"rounds": 2, "last_round": 4, "head": heads["s2"], "last_seq": 5},
    }


def test_verify_passes_a_good_log(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    code, out, err = run_cli("verify", directory)
    assert (code, err) == (0, "")
    assert out == (
        f"{directory}: OK: 5 records in 2 segments, 0 snapshots; chain checked by: none "
        "registered\n"
    )


def test_verify_fails_naming_the_file_and_offset_of_a_bad_checksum(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    flip(directory / SEG1, 24 + 29 + 25)  # a payload byte of record 2
    code, out, err = run_cli("verify", directory)
    assert (code, out) == (1, "")
    assert err.startswith(
        f"muser wal verify: FAILED: {directory / SEG1}: byte offset 53: record checksum mismatch"
    )
    assert err.endswith("; a good record follows at byte offset 82\n")


def test_verify_json(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    code, out, _ = run_cli("verify", directory, "--json")
    assert code == 0
    assert json.loads(out) == {
        "ok": True,
        "failure": None,
        "records": 5,
        "segments": 2,
        "snapshots": 0,
        "chain_checked_by": [],
        "torn_tail": None,
    }


def test_verify_checks_hash_chains_and_signatures_through_the_hook(tmp_path, run_cli, key):
    register_interpreter(ToyInterpreter())
    directory = round_log(tmp_path / "log", key)
    pub = tmp_path / "verifier.pub"
    pub.write_bytes(raw_public(key))
    code, out, _ = run_cli("verify", directory, "--pubkey", pub)
    assert code == 0
    assert out.endswith("chain checked by: toy-round\n")
    other = tmp_path / "other.pub"
    other.write_bytes(raw_public(Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)))
    code, _, err = run_cli("verify", directory, "--pubkey", other)
    assert code == 1
    assert err == (
        "muser wal verify: FAILED: toy-round: seq 1: session s1 round 0: no given public key "
        "verifies its signature\n"
    )


def test_verify_names_the_first_broken_link(tmp_path, run_cli, key):
    register_interpreter(ToyInterpreter())
    directory = round_log(tmp_path / "log", key, tamper=3)
    code, _, err = run_cli("verify", directory)
    assert code == 1
    _, s1_after_2 = make_round("s1", 2, make_round("s1", 0, GENESIS, key)[1], key)
    assert err == (
        f"muser wal verify: FAILED: toy-round: seq 4: session s1 round 3: links to head "
        f"{GENESIS[:12]}, the chain is at {s1_after_2[:12]}\n"
    )


def test_the_hook_receives_the_latest_snapshot(tmp_path, run_cli, key):
    seen = []

    class Spy(ToyInterpreter):
        def check_chain(self, records, pubkeys, snapshot):
            seen.append((snapshot, [r.seq for r in records], pubkeys))
            return None

    register_interpreter(Spy())
    with FileLog(tmp_path / "log") as log:
        log.append(b"a")
        log.write_snapshot(b"{}")
        log.append(b"b")
    assert run_cli("verify", tmp_path / "log")[0] == 0
    assert seen == [(Snapshot(1, b"{}"), [1, 2], [])]


def test_verify_refuses_an_unreadable_key_file(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    code, _, err = run_cli("verify", directory, "--pubkey", tmp_path / "absent.pub")
    assert code == 2
    assert err.startswith(f"muser wal: cannot read public key file {tmp_path / 'absent.pub'}: ")


def test_a_directory_that_does_not_exist_is_refused(tmp_path, run_cli):
    for action in ("inspect", "verify", "repair"):
        code, _, err = run_cli(action, tmp_path / "nope")
        assert (code, err) == (2, f"muser wal: {tmp_path / 'nope'} is not a directory\n")


def test_an_interpreter_that_cannot_be_imported_is_refused(tmp_path, run_cli):
    """Bad input (exit 2), naming what was asked for and what is expected."""
    code, _, err = run_cli("inspect", tmp_path, "--interpreter", "no_such_module_xyz")
    assert code == 2
    assert "cannot import record interpreter module 'no_such_module_xyz'" in err
    assert "expected MODULE or MODULE:ATTR naming an importable record interpreter" in err
    code, _, err = run_cli("inspect", tmp_path, "--interpreter", "toy_rounds:Nothing")
    assert code == 2 and "module 'toy_rounds' has no attribute 'Nothing'" in err


def test_an_object_that_is_not_an_interpreter_is_refused(tmp_path, run_cli):
    code, _, err = run_cli("inspect", tmp_path, "--interpreter", "toy_rounds:PREFIX")
    assert code == 2
    assert "is not a RecordInterpreter" in err


def test_wal_without_an_action_prints_usage(run_cli):
    code, out, err = run_cli()
    assert code == 2
    assert "inspect" in err and "verify" in err and "repair" in err


# ---- repair -------------------------------------------------------------------------------


def test_repair_moves_the_bad_tail_aside_and_the_log_opens_afterwards(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    flip(directory / SEG1, 24 + 29 + 25)
    original = (directory / SEG1).read_bytes()
    code, out, err = run_cli("repair", directory)
    assert (code, err) == (0, "")
    quarantine = directory / "quarantine" / "repair-0001"
    lines = out.splitlines()
    assert lines[0] == f"repaired {directory}:"
    assert lines[1].startswith(f"  problem: {SEG1}: byte offset 53: record checksum mismatch")
    assert lines[2:] == [
        f"  kept:    {SEG1}: bytes 0..53 (records 1..1)",
        f"  moved:   {SEG1} bytes 53..111 (whole original copied) -> {quarantine / SEG1}",
        f"  moved:   seg-00000000000000000004.wal -> {quarantine / 'seg-00000000000000000004.wal'}",
        f"  the log now holds records 1..1 and opens cleanly; nothing was deleted (see "
        f"{quarantine})",
    ]
    assert (quarantine / SEG1).read_bytes() == original
    assert (directory / SEG1).read_bytes() == original[:53]
    with FileLog(directory) as log:
        assert [r.payload for r in log.records()] == [b"payload 0"]
        assert log.append(b"next") == 2
    assert run_cli("verify", directory)[0] == 0


def test_repair_json_and_a_second_repair_finds_nothing(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    (directory / "seg-00000000000000000004.wal").write_bytes(encode_segment_header(4)[:5])
    code, out, _ = run_cli("repair", directory, "--json")
    assert code == 0
    quarantine = directory / "quarantine" / "repair-0001"
    assert json.loads(out) == {
        "directory": str(directory),
        "problems": [
            "seg-00000000000000000004.wal: byte offset 0: segment header truncated (5 of 24 bytes)"
        ],
        "kept": [],
        "moved": [
            {
                "file": "seg-00000000000000000004.wal",
                "to": str(quarantine / "seg-00000000000000000004.wal"),
            }
        ],
        "quarantine": str(quarantine),
        "first_seq": 1,
        "last_seq": 3,
    }
    code, out, _ = run_cli("repair", directory)
    assert (code, out) == (0, f"{directory}: nothing to repair; records 1..3 are intact\n")


def test_repair_of_a_bad_snapshot_falls_back_to_the_previous_one(tmp_path, run_cli):
    with FileLog(tmp_path, keep_snapshots=2) as log:
        for i in range(4):
            log.append(b"%d" % i)
            log.write_snapshot(b"state %d" % i)
    flip(tmp_path / "snap-00000000000000000004.snap", 33)
    assert run_cli("repair", tmp_path)[0] == 0
    assert (tmp_path / "quarantine" / "repair-0001" / "snap-00000000000000000004.snap").exists()
    with FileLog(tmp_path) as log:
        assert log.latest_snapshot() == Snapshot(3, b"state 2")
        assert [r.seq for r in log.records(4)] == [4]


def test_repair_of_a_segment_the_snapshot_covers_keeps_everything_after_it(tmp_path, run_cli):
    with FileLog(tmp_path, segment_bytes=100, keep_snapshots=2) as log:
        for i in range(9):
            log.append(b"payload %d" % i)
        log.write_snapshot(b"a", seq=1)
        log.write_snapshot(b"b", seq=7)
    flip(tmp_path / "seg-00000000000000000004.wal", 30)
    code, out, _ = run_cli("repair", tmp_path)
    assert code == 0
    moved = sorted(p.name for p in (tmp_path / "quarantine" / "repair-0001").iterdir())
    assert moved == [SEG1, "seg-00000000000000000004.wal"]
    with FileLog(tmp_path) as log:
        assert log.latest_snapshot() == Snapshot(7, b"b")
        assert [r.seq for r in log.records(8)] == [8, 9]


def test_repair_of_a_torn_tail_keeps_the_torn_bytes_in_quarantine(tmp_path, run_cli):
    directory = plain_log(tmp_path / "log")
    with (directory / "seg-00000000000000000004.wal").open("ab") as handle:
        handle.write(b"\xa5WR")
    assert run_cli("repair", directory)[0] == 0
    copy = directory / "quarantine" / "repair-0001" / "seg-00000000000000000004.wal"
    assert copy.read_bytes().endswith(b"\xa5WR")
    with FileLog(directory) as log:
        assert log.recovery.torn_tail is None
        assert log.last_seq == 5


def test_repair_refuses_a_log_that_is_open(tmp_path, run_cli):
    with FileLog(tmp_path):
        code, _, err = run_cli("repair", tmp_path)
    assert code == 2
    assert "is locked by another writer" in err


def test_repair_refuses_a_newer_format_version(tmp_path, run_cli):
    import struct

    import crc32c

    head = b"MUSERWAL" + struct.pack("<IQ", 2, 1)
    (tmp_path / SEG1).write_bytes(head + struct.pack("<I", crc32c.crc32c(head)))
    code, _, err = run_cli("repair", tmp_path)
    assert code == 2
    assert "format version 2" in err
    assert not (tmp_path / "quarantine").exists()


def test_verify_fails_on_a_bad_older_snapshot_that_open_does_not_read(tmp_path, run_cli):
    with FileLog(tmp_path, keep_snapshots=2) as log:
        log.append(b"a")
        log.write_snapshot(b"one")
        log.append(b"b")
        log.write_snapshot(b"two")
    flip(tmp_path / "snap-00000000000000000001.snap", 33)
    with FileLog(tmp_path) as log:
        assert log.latest_snapshot() == Snapshot(2, b"two")
    code, _, err = run_cli("verify", tmp_path)
    assert code == 1
    assert err.startswith(
        f"muser wal verify: FAILED: {tmp_path / 'snap-00000000000000000001.snap'}: byte offset 0: "
        "snapshot checksum mismatch"
    )


def test_repair_that_cannot_make_progress_stops_with_an_error(tmp_path, run_cli, monkeypatch):
    import wal.repair

    directory = plain_log(tmp_path / "log")
    flip(directory / SEG1, 30)
    monkeypatch.setattr(wal.repair, "_fix_one", lambda found, issue, mover: None)
    code, _, err = run_cli("repair", directory)
    assert code == 3
    assert err.startswith(f"muser wal: repair of {directory} did not converge at Problem(")
