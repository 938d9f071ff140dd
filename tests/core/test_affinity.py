"""Pinning this process to CPUs: every thread moves, threads started later inherit it, the
old CPUs come back, and CPUs the process may not use are refused before anything moves."""

from __future__ import annotations

import os
import threading

import pytest

from muser import affinity
from muser.affinity import AffinityError

linux = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs Linux and at least two CPUs to tell a pin from no pin",
)


def _threads_cpus() -> dict[int, frozenset[int]]:
    """Each live thread's CPUs; a thread that ends between the listing and the query (a
    thread just joined, another test's pool winding down) is left out."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[int(t)] = frozenset(os.sched_getaffinity(int(t)))
        except ProcessLookupError:
            continue
    return out


class _Idle(threading.Thread):
    """A thread that waits until told to stop, reporting its own CPUs on the way out."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop, self.ready, self.cpus = threading.Event(), threading.Event(), None

    def run(self) -> None:
        self.ready.set()
        self.stop.wait()
        self.cpus = frozenset(os.sched_getaffinity(0))


@linux
def test_pinned_moves_every_thread_and_gives_them_back():
    before = _threads_cpus()
    cpu = min(os.sched_getaffinity(0))
    older = _Idle()
    older.start()
    older.ready.wait()
    with affinity.pinned([cpu]):
        assert set(_threads_cpus().values()) == {frozenset({cpu})}  # the older thread too
        newer = _Idle()
        newer.start()  # started inside: inherits the pin
        newer.ready.wait()
        newer.stop.set()
        newer.join()
        assert newer.cpus == {cpu}
    older.stop.set()
    older.join()
    assert older.cpus == before[os.getpid()]
    now = _threads_cpus()
    assert {t: now[t] for t in before if t in now} == {t: before[t] for t in before if t in now}


@linux
def test_status_names_the_cpus_a_process_is_confined_to_and_none_when_it_has_them_all(
    monkeypatch,
):
    cpu = min(os.sched_getaffinity(0))
    with affinity.pinned([cpu]):
        assert affinity.pinned_to() == [cpu]
    monkeypatch.setattr(affinity, "allowed", lambda: frozenset(range(os.cpu_count())))
    assert affinity.pinned_to() is None  # may run on every CPU of the machine


def test_pinned_none_changes_nothing():
    before = _threads_cpus()
    with affinity.pinned(None):
        assert _threads_cpus() == before


@linux
def test_a_cpu_the_process_may_not_use_is_refused_before_anything_moves():
    before = _threads_cpus()
    have = sorted(os.sched_getaffinity(0))
    with pytest.raises(AffinityError) as err:
        affinity.pin_process([have[0], 4096], "proposer.cpus")
    message = str(err.value)
    assert "proposer.cpus" in message and "CPU 4096" in message and str(have) in message
    assert _threads_cpus() == before


def test_a_platform_that_cannot_pin_is_refused(monkeypatch):
    monkeypatch.setattr(affinity, "allowed", lambda: None)
    with pytest.raises(AffinityError, match="verifier.cpus \\[0\\]: this platform cannot pin"):
        affinity.check([0], "verifier.cpus")
    assert affinity.pinned_to() is None


def test_two_machines_on_one_get_disjoint_halves():
    assert affinity.split_for_two(None) is None
    assert affinity.split_for_two(frozenset({3})) is None
    assert affinity.split_for_two(frozenset({0, 1})) == ([0], [1])
    assert affinity.split_for_two(frozenset({2, 5, 7})) == ([2], [5, 7])
    assert affinity.split_for_two(frozenset(range(16))) == (list(range(8)), list(range(8, 16)))


class _Client:
    """A fake `stream_generate` that records the CPUs of the thread each run calls it on."""

    def __init__(self) -> None:
        self.seen: list[set[int]] = []

    def __call__(self, *args, **kwargs) -> dict:
        self.seen.append(os.sched_getaffinity(0))
        from muser_app.bench.cluster import AHEAD

        stats = {"drafted": 1, "accepted": 1, "rounds": 1, "split_s": {}}
        return {"tokens": [1], "stats": {**stats, "speculation": dict.fromkeys(AHEAD, 0)}}


@linux
def test_a_pinned_cluster_run_is_the_client_on_the_proposers_cpus_and_only_while_it_runs():
    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import _lane

    before, client = os.sched_getaffinity(0), _Client()
    cpus = {"proposer": [max(before)], "verifier": [min(before)]}
    run = _lane(client, "127.0.0.1:1", SamplingParams(), 4, {}, cpus)
    run([5], 1)
    assert client.seen == [{max(before)}] and os.sched_getaffinity(0) == before
    assert run.cpus == cpus  # what the sessions suite pins a wave's clients to
    _lane(client, "127.0.0.1:1", SamplingParams(), 4, {}, None)([5], 1)
    assert client.seen[1] == before  # unpinned (bench --no-pin): where the OS puts it


@linux
def test_a_waves_clients_run_on_the_proposers_cpus_and_the_harness_gets_its_own_back():
    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import _lane
    from muser_app.bench.sessions import run_concurrent

    before, client = os.sched_getaffinity(0), _Client()
    lane = _lane(client, "127.0.0.1:1", SamplingParams(), 4, {}, {"proposer": [max(before)]})
    run_concurrent(lane, [[1], [2], [3], [4]], 1)  # one client thread each
    assert client.seen == [{max(before)}] * 4
    assert os.sched_getaffinity(0) == before
