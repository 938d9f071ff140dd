"""The FragmentStore contract, run against both stores (`store_env`), then the file store."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from wal import FileFragmentStore, FragmentStore
from wal.errors import (
    FragmentCorruptError,
    FragmentMissingError,
    InvalidDigestError,
    WalClosedError,
    WalLockedError,
    WalUsageError,
)

A, B, C = b"alpha", b"bravo", b"charlie"
DA, DB, DC = (hashlib.sha256(x).hexdigest() for x in (A, B, C))


def test_both_stores_satisfy_the_protocol(store_env):
    assert isinstance(store_env.open(), FragmentStore)


def test_put_returns_the_sha256_and_get_returns_the_bytes(store_env):
    store = store_env.open()
    assert store.put(A) == DA
    assert store.get(DA) == A
    assert store.has(DA) is True
    assert store.has(DB) is False
    assert store.digests() == [DA]


def test_a_duplicate_put_costs_no_second_write(store_env):
    store = store_env.open()
    assert [store.put(A), store.put(A), store.put(bytearray(A))] == [DA, DA, DA]
    assert store.writes == 1
    assert store.digests() == [DA]


def test_reordered_and_duplicated_puts_end_in_the_same_store(store_env):
    store = store_env.open()
    for blob in (C, A, C, B, A):
        store.put(blob)
    assert store.digests() == sorted([DA, DB, DC])
    assert store.writes == 3
    assert [store.get(d) for d in (DA, DB, DC)] == [A, B, C]


def test_the_closure_check_lists_missing_digests_once_in_order(store_env):
    store = store_env.open()
    store.put(B)
    assert store.missing([DC, DB, DA, DC, DB]) == [DC, DA]
    assert store.missing([]) == []
    store.put(C)
    store.put(A)
    assert store.missing([DC, DB, DA]) == []


def test_get_of_an_absent_fragment_is_refused(store_env):
    store = store_env.open()
    with pytest.raises(FragmentMissingError) as info:
        store.get(DA)
    assert DA in str(info.value)


@pytest.mark.parametrize("bad", ["ABC", DA.upper(), DA[:-1], DA + "0", 42, None])
def test_a_malformed_digest_is_refused(store_env, bad):
    store = store_env.open()
    with pytest.raises(InvalidDigestError) as info:
        store.get(bad)
    assert str(info.value) == (
        f"a fragment digest is 64 lowercase hex characters (SHA-256), got {bad!r}"
    )
    for call in (store.has, lambda d: store.missing([d]), lambda d: store.pin("o", [d])):
        with pytest.raises(InvalidDigestError):
            call(bad)
    with pytest.raises(InvalidDigestError):
        store.gc([bad])


def test_a_fragment_that_is_not_bytes_is_refused(store_env):
    store = store_env.open()
    with pytest.raises(WalUsageError) as info:
        store.put("text")
    assert str(info.value) == "a fragment is bytes, got str"


def test_a_corrupted_fragment_is_refused_on_read_and_healed_by_a_new_put(store_env):
    store = store_env.open()
    store.put(A)
    store_env.corrupt(store, DA, b"alphA")
    with pytest.raises(FragmentCorruptError) as info:
        store.get(DA)
    assert hashlib.sha256(b"alphA").hexdigest() in str(info.value)
    assert store.has(DA) is False  # moved to quarantine, so a re-fetch is not skipped
    assert store.missing([DA]) == [DA]
    assert store.put(A) == DA
    assert store.get(DA) == A
    assert store.writes == 2


def test_gc_removes_only_unreferenced_fragments_past_the_grace_period(store_env):
    store = store_env.open(grace_seconds=600)
    for blob in (A, B, C):
        store.put(blob)
    clock = store_env.clock
    assert store.gc([DA]) == 0  # everything was just put: within grace
    clock.now += 600
    assert store.gc([DA]) == 2  # B and C: unreferenced, 600 s old
    assert store.digests() == [DA]
    assert store.get(DA) == A


def test_gc_keeps_pinned_fragments_until_unpinned(store_env):
    store = store_env.open(grace_seconds=0)
    store.put(A)
    store.put(B)
    store.pin("session-1/round-4", [DA, DB])
    store.pin("session-2/round-1", [DB])
    assert store.gc() == 0
    assert store.unpin("session-1/round-4") == 2
    assert store.gc() == 1  # A; B is still pinned by session 2
    assert store.digests() == [DB]
    assert store.unpin("session-2/round-1") == 1
    assert store.unpin("never-pinned") == 0
    assert store.gc() == 1
    assert store.digests() == []


def test_a_closure_check_restarts_the_grace_period(store_env):
    store = store_env.open(grace_seconds=600)
    store.put(A)
    store_env.clock.now += 500
    assert store.missing([DA]) == []  # a round names A: it must survive until it commits
    store_env.clock.now += 500
    assert store.gc() == 0
    store_env.clock.now += 100
    assert store.gc() == 1


def test_a_duplicate_put_restarts_the_grace_period(store_env):
    store = store_env.open(grace_seconds=600)
    store.put(A)
    store_env.clock.now += 599
    store.put(A)
    store_env.clock.now += 599
    assert store.gc() == 0
    assert store.gc(now=store_env.clock.now + 1) == 1


def test_a_negative_grace_period_is_refused(store_env):
    with pytest.raises(WalUsageError) as info:
        store_env.open(grace_seconds=-1)
    assert str(info.value) == "grace_seconds must be >= 0, got -1"


def test_a_closed_store_refuses_every_operation(store_env):
    store = store_env.open()
    store.put(A)
    store.close()
    for call in (
        lambda: store.put(B),
        lambda: store.get(DA),
        lambda: store.has(DA),
        lambda: store.missing([DA]),
        lambda: store.pin("o", [DA]),
        lambda: store.gc(),
    ):
        with pytest.raises(WalClosedError):
            call()


def test_concurrent_puts_of_the_same_bytes_store_one_fragment(store_env):
    store = store_env.open()
    blob = os.urandom(100_000)
    threads = [threading.Thread(target=store.put, args=(blob,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    digest = hashlib.sha256(blob).hexdigest()
    assert store.digests() == [digest]
    assert store.get(digest) == blob


# ---- the file store -----------------------------------------------------------------------


def test_file_layout_is_objects_fanout_digest(tmp_path):
    with FileFragmentStore(tmp_path) as store:
        store.put(A)
    assert (tmp_path / "objects" / DA[:2] / DA).read_bytes() == A
    assert list((tmp_path / "tmp").iterdir()) == []


def test_fragments_survive_reopen(tmp_path):
    with FileFragmentStore(tmp_path) as store:
        store.put(A)
        store.put(B)
    with FileFragmentStore(tmp_path) as store:
        assert store.digests() == sorted([DA, DB])
        assert store.put(A) == DA
        assert store.writes == 0


def test_temp_files_of_a_crashed_put_are_removed_at_open(tmp_path):
    with FileFragmentStore(tmp_path) as store:
        store.put(A)
    (tmp_path / "tmp" / f"{DB}.123.1").write_bytes(b"bra")
    with FileFragmentStore(tmp_path) as store:
        assert store.digests() == [DA]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_second_store_on_the_same_directory_is_refused(tmp_path):
    with FileFragmentStore(tmp_path), pytest.raises(WalLockedError):
        FileFragmentStore(tmp_path)


def test_a_corrupted_file_is_moved_to_quarantine_not_deleted(tmp_path):
    with FileFragmentStore(tmp_path) as store:
        store.put(A)
        (tmp_path / "objects" / DA[:2] / DA).write_bytes(b"rotten")
        with pytest.raises(FragmentCorruptError) as info:
            store.get(DA)
        moved = list((tmp_path / "quarantine").iterdir())
        assert [p.read_bytes() for p in moved] == [b"rotten"]
        assert str(moved[0]) in str(info.value)


def test_after_a_restart_gc_counts_grace_from_the_file_mtime(tmp_path):
    with FileFragmentStore(tmp_path) as store:
        store.put(A)
        store.put(B)
    old = 1_000_000.0
    os.utime(tmp_path / "objects" / DA[:2] / DA, (old, old))
    os.utime(tmp_path / "objects" / DB[:2] / DB, (old + 500, old + 500))
    with FileFragmentStore(tmp_path, grace_seconds=600, clock=lambda: old + 700) as store:
        assert store.gc() == 1
        assert store.digests() == [DB]


def test_a_put_that_finds_its_fragment_there_makes_its_name_durable_first(tmp_path, monkeypatch):
    """Regression: a put that found the file (another thread renamed it and had not fsynced
    its directory yet, or a crash came between a rename and that fsync) returned at once,
    and its caller could commit a record naming a fragment a power loss removes. Now such a
    put fsyncs the fan-out directory and objects/ first, once per process."""
    from wal import _fs

    with FileFragmentStore(tmp_path) as store:
        store.put(A)
    synced: list[str] = []
    real = _fs.fsync_dir
    monkeypatch.setattr(_fs, "fsync_dir", lambda d: (synced.append(str(d)), real(d)))
    with FileFragmentStore(tmp_path) as store:  # another process: it saw nothing fsynced
        assert store.put(A) == DA and store.writes == 0
        objects = tmp_path / "objects"
        assert synced == [str(objects), str(objects / DA[:2])]
        synced.clear()
        assert store.put(A) == DA and synced == []  # durable now: at once


def test_a_put_into_a_fan_out_directory_another_put_made_fsyncs_objects(tmp_path, monkeypatch):
    """Regression: a put that found its fan-out directory there skipped the fsync of
    objects/, though the put that made the directory might not have fsynced it yet."""
    from wal import _fs

    with FileFragmentStore(tmp_path) as store:
        store.put(A)
    same_fanout = next(
        data
        for i in range(100_000)
        if (data := b"%d" % i) != A and hashlib.sha256(data).hexdigest()[:2] == DA[:2]
    )
    synced: list[str] = []
    real = _fs.fsync_dir
    monkeypatch.setattr(_fs, "fsync_dir", lambda d: (synced.append(str(d)), real(d)))
    with FileFragmentStore(tmp_path) as store:
        store.put(same_fanout)
    objects = tmp_path / "objects"
    assert synced == [str(objects), str(objects / DA[:2])]
