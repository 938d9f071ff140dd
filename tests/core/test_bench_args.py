"""`muser bench`'s counts, delays and sampling settings: refused by name (exit 2) before
any fixture is built or daemon started; good ones parsed as the suites use them."""

from __future__ import annotations

import argparse

import pytest

from muser_app.cli.bench import _check_counts
from muser_app.cli.main import main


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--draft-len", "-1"], "--draft-len must be >= 0, got -1"),
        (["--q-top-k", "0"], "--q-top-k must be >= 1, got 0"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["--seed", "-3"], "seed must be in [0, 2**32), got -3"),
        (["--cluster-delays", "x"], "--cluster-delays: expected milliseconds >= 0"),
        (["--cluster-delays", "0,-5"], "got '-5' in '0,-5'"),
        (["--cluster-delays", "nan"], "got 'nan'"),
        (["--suite", "sessions", "--sessions", "0,8"], "--sessions: expected counts >= 1"),
        (["--suite", "sessions", "--sessions", "one"], "got 'one'"),
        (["--suite", "sessions", "--sessions", ""], "got ''"),
        (["--suite", "sessions", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--widen-target", "0"], "--widen-target must be >= 1, got 0"),
        (["--suite", "sessions", "--widen-target", "-4"], "--widen-target must be >= 1, got -4"),
        (["--widen-draft", "0"], "--widen-draft must be >= 1, got 0"),
        (["--tree-nodes", "-1"], "--tree-nodes must be >= 0, got -1"),
        (["--tree-nodes", "65"], "--tree-nodes must be <= 64 (lane.tree_nodes), got 65"),
        (["--variants-only"], "--variants-only runs the --cluster-variant clusters: give one"),
        (["--qualify-tolerance", "-1"], "--qualify-tolerance must be a finite number >= 0"),
        (["--qualify-tolerance", "nan"], "--qualify-tolerance must be a finite number >= 0"),
    ],
)
def test_bad_counts_are_refused_before_any_work(args, says, tmp_path, capsys, monkeypatch):
    import muser_app.fixtures

    def no_fixtures(*a, **k):
        raise AssertionError("the refusal comes first")

    monkeypatch.setattr(muser_app.fixtures, "build_fixtures", no_fixtures)
    receipt = tmp_path / "r.json"
    assert main(["bench", "--no-peers", "--receipt", str(receipt), *args]) == 2
    assert says in capsys.readouterr().err
    assert not receipt.exists()


def namespace(**kw) -> argparse.Namespace:
    base = dict(suite="lanes", max_tokens=4, repeats=1, draft_len=4, q_top_k=8, prompts=1)
    base |= dict(temperature=0.0, seed=0, cluster_delays="0", sessions="1,8")
    base |= dict(widen_target=1, widen_draft=1, tree_nodes=0)
    return argparse.Namespace(**(base | kw))


def test_good_delays_and_session_counts_are_parsed():
    args = namespace(cluster_delays=" 0, 5 ,20.5,")
    _check_counts(args)
    assert args.cluster_delays == [0.0, 5.0, 20.5]
    args = namespace(cluster_delays="")
    _check_counts(args)
    assert args.cluster_delays == []  # no cluster lanes
    args = namespace(suite="sessions", sessions="8, 1,8", prompts=0)  # --prompts: lanes only
    _check_counts(args)
    assert args.sessions == [1, 8] and args.cluster_delays == [0.0]


class Started(Exception):
    """Raised where the suite would start its first run: what it was given is recorded."""


@pytest.mark.parametrize("suite", ["lanes", "sessions"])
def test_widening_gives_every_lane_the_widened_models(suite, tmp_path, monkeypatch):
    import shutil

    import muser_app.bench.cluster
    import muser_app.bench.lanes
    import muser_app.bench.sessions
    import muser_app.fixtures
    from muser_app.fixtures import FixturePair, Fixtures
    from muser_app.fixtures.widen import widened_dir

    fixtures = muser_app.fixtures.build_fixtures(progress=False)
    pair = FixturePair(
        shutil.copytree(fixtures.natural.target, tmp_path / "target"),
        shutil.copytree(fixtures.natural.draft, tmp_path / "draft"),
    )
    monkeypatch.setattr(
        muser_app.fixtures, "build_fixtures", lambda **k: Fixtures(pair, pair, tmp_path)
    )
    given = []

    def oracle(target, *a, **k):
        given.append(target)

    def started(target, draft, *a, **k):
        given.append((target, draft))
        raise Started

    monkeypatch.setattr(muser_app.bench.lanes, "build_lanes", started)  # the lanes and the peers
    monkeypatch.setattr(muser_app.bench.sessions, "oracle_tokens", oracle)  # the sessions' oracle
    monkeypatch.setattr(muser_app.bench.cluster, "cluster_lanes", started)  # the sessions' cluster
    with pytest.raises(Started):
        main(["bench", "--suite", suite, "--widen-target", "4", "--widen-draft", "2"])
    wide = (widened_dir(pair.target, 4), widened_dir(pair.draft, 2))
    assert given == ([wide[0]] if suite == "sessions" else []) + [wide]
    assert all((d / "config.json").is_file() for d in wide)


def test_a_widened_run_says_so_above_its_table():
    from muser_app.cli.bench import _widened_label

    assert _widened_label(namespace()) is None
    assert _widened_label(namespace(widen_target=8, widen_draft=1)).startswith(
        "WIDENED PAIR: target x8, draft x1 "
    )
