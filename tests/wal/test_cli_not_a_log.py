"""`muser wal inspect|verify|repair DIR` on a directory that holds no commit log: refused
(exit 2) saying what was expected and, where a subdirectory holds one, naming it; repair
writes nothing there (no LOCK). A real log, even an empty one, is not refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from wal import FileLog

SEG1 = "seg-00000000000000000001.wal"
ACTIONS = ["inspect", "verify", "repair"]


def tree(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def a_log(directory: Path, records: int = 2) -> Path:
    with FileLog(directory) as log:
        for i in range(records):
            log.append(b"record %d" % i)
    return directory


@pytest.mark.parametrize("action", ACTIONS)
def test_an_empty_directory_is_refused_and_left_as_it_was(tmp_path, run_cli, action):
    directory = tmp_path / "empty"
    directory.mkdir()
    code, out, err = run_cli(action, directory)
    assert code == 2 and out == ""
    assert err.startswith(f"muser wal: {directory} holds no commit log: no seg-*.wal segment")
    assert "expected" in err
    assert tree(directory) == []  # repair took no LOCK, made no quarantine/


@pytest.mark.parametrize("action", ACTIONS)
def test_a_directory_of_other_files_is_refused(tmp_path, run_cli, action):
    directory = tmp_path / "junk"
    directory.mkdir()
    (directory / "00000001.seg").write_bytes(b"MUSERWAL")
    (directory / "random.bin").write_bytes(bytes(range(256)))
    before = tree(directory)
    code, _, err = run_cli(action, directory)
    assert code == 2 and f"{directory} holds no commit log" in err
    assert "did you mean" not in err
    assert tree(directory) == before


@pytest.mark.parametrize("action", ACTIONS)
def test_the_daemons_wal_dir_is_refused_naming_the_log_below_it(tmp_path, run_cli, action):
    wal_dir = tmp_path / "wal" / "verifier"
    a_log(wal_dir / "commit")
    before = tree(wal_dir)
    code, _, err = run_cli(action, wal_dir)
    assert code == 2
    assert f"did you mean {wal_dir / 'commit'}?" in err
    assert tree(wal_dir) == before
    code, _, err = run_cli(action, tmp_path / "wal")  # two levels up
    assert code == 2 and f"did you mean {wal_dir / 'commit'}?" in err


def test_several_logs_below_are_all_named(tmp_path, run_cli):
    a_log(tmp_path / "verifier" / "commit")
    a_log(tmp_path / "proposer" / "journal")
    code, _, err = run_cli("verify", tmp_path)
    assert code == 2
    assert f"did you mean {tmp_path / 'proposer' / 'journal'} or " in err
    assert str(tmp_path / "verifier" / "commit") in err


def test_a_fresh_empty_log_is_a_log(tmp_path, run_cli):
    directory = a_log(tmp_path / "log", records=0)
    assert (directory / SEG1).is_file()  # opening a log writes its first segment at once
    code, out, _ = run_cli("verify", directory)
    assert code == 0 and "OK: 0 records in 1 segments" in out
    assert run_cli("inspect", directory)[0] == 0
    code, out, _ = run_cli("repair", directory)
    assert code == 0 and "nothing to repair" in out


def test_a_log_whose_only_segment_repair_moved_aside_is_still_a_log(tmp_path, run_cli):
    directory = a_log(tmp_path / "log")
    segment = directory / SEG1
    segment.write_bytes(b"X" + segment.read_bytes()[1:])  # a bad header: moved aside whole
    assert run_cli("repair", directory)[0] == 0
    assert not list(directory.glob("seg-*.wal"))  # only quarantine/ and LOCK are left
    code, out, _ = run_cli("verify", directory)
    assert code == 0 and "OK: 0 records in 0 segments" in out
    with FileLog(directory) as log:  # and it opens
        assert log.last_seq == 0
