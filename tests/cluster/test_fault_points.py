"""Every step of the durable transaction, killed on purpose (muser.faults).

A sweep arms one daemon at a time with MUSER_TEST_CRASH_AT: it SIGKILLs itself at that
point of a round (the N-th time it gets there), is restarted at once armed at the next
point, and so on through every point of its side of docs/design.md §6, once with sampling and
once greedy, while generations of one request run through the cluster. Every generation
ends with the text of the uncrashed run (the client refuses a gap or a repeat), every kill
is the armed point's (its log line says so), and both WALs verify afterwards, with no
session resumed (after every restart the verifier held the round the proposer carried).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from muser import faults
from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import stream_generate
from tests.cluster.conftest import make_cluster
from tests.cluster.test_crash import Client, _prompt, assert_wals_verify

SAMPLED = SamplingParams(temperature=1.0, max_tokens=96, seed=77)
MODES = {"sampled": SAMPLED, "greedy": dataclasses.replace(SAMPLED, temperature=0.0)}


def sweep(cluster, victim: str, params: SamplingParams, reference, nth: list[int]) -> int:
    """Kill `victim` at each of its points in turn, the i-th at its `nth[i]`-th time,
    restarting it armed at the next; as many generations as that takes, each ending with
    `reference`. Returns the kills (one per point)."""
    daemon = getattr(cluster, victim)
    points = [f"{victim}.{step}" for step in faults.POINTS[victim]]
    plan = list(zip(points, nth, strict=True))

    def arm(i: int) -> None:
        if i < len(plan):
            daemon.env[faults.ENV] = f"{plan[i][0]}@{plan[i][1]}"
        else:
            daemon.env.pop(faults.ENV, None)
        daemon.start()

    daemon.stop()
    arm(0)
    kills = 0
    deadline = time.monotonic() + 600
    while kills < len(plan):
        assert time.monotonic() < deadline, f"{plan[kills][0]} never reached"
        client = Client(cluster.address, cluster.prompt, params, cluster.config.limits)
        client.start()
        while client.is_alive() or not daemon.alive():
            if not daemon.alive():
                tail = daemon.log_tail()
                point = plan[kills][0]
                assert f"{faults.ENV}: {point} reached" in tail, f"{victim} died elsewhere:\n{tail}"
                kills += 1
                arm(kills)
            time.sleep(0.005)
        client.join(300)
        assert client.error is None, f"{client.error}\n{cluster.proposer.log_tail()}"
        assert client.result["tokens"] == reference, f"after {kills} kills of the {victim}"
    return kills


@pytest.fixture
def cluster(tmp_path, fixture_pair):
    c = make_cluster(tmp_path, fixture_pair, draft_len=2)
    c.prompt = _prompt(fixture_pair)
    c.start()
    yield c
    c.stop()


def references(cluster) -> dict[str, list[int]]:
    """Each mode's uncrashed run, on this cluster before any kill."""
    return {
        mode: stream_generate(cluster.address, cluster.prompt, params)["tokens"]
        for mode, params in MODES.items()
    }


@pytest.mark.parametrize("victim", ["verifier", "proposer"])
def test_a_kill_at_every_step_of_the_transaction_changes_nothing(cluster, victim):
    reference = references(cluster)
    kills = 0
    for mode, params in MODES.items():
        kills += sweep(cluster, victim, params, reference[mode], [2] * len(faults.POINTS[victim]))
    assert kills == 2 * len(faults.POINTS[victim])
    cluster.stop()
    assert_wals_verify(cluster)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("victim", ["verifier", "proposer"])
def test_five_kills_at_every_step_of_the_transaction(cluster, victim):
    """Each point killed at its 1st to 5th time, sampled and greedy."""
    reference = references(cluster)
    steps = len(faults.POINTS[victim])
    kills = 0
    for nth in range(1, 6):
        for mode, params in MODES.items():
            kills += sweep(cluster, victim, params, reference[mode], [nth] * steps)
    assert kills == 10 * steps
    cluster.stop()
    assert_wals_verify(cluster)


def test_a_crash_setting_that_names_no_point_is_refused():
    with pytest.raises(faults.FaultSettingError) as err:
        faults.parse("verifier.after_nothing@2")
    assert "verifier.after_compute" in str(err.value)  # the points it could have named
    with pytest.raises(faults.FaultSettingError, match="positive integer"):
        faults.parse("verifier.after_compute@0")
    assert faults.parse("proposer.after_ack") == ("proposer.after_ack", 1)
    assert faults.parse("verifier.after_emit@7") == ("verifier.after_emit", 7)
