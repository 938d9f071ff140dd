"""`muser bench --cluster-variant`: a second cluster's settings, parsed and written into the
cluster file it runs from, or refused before any work with what was wrong; in the sessions
suite every wave runs on both clusters."""

from __future__ import annotations

import pytest

from cluster_config import load_config
from muser_app.bench.cluster import PACKAGES, parse_variant, with_settings
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main
from muser_app.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("variant")
    pair = make_tiny_checkpoint(root / "t", seed=1), make_tiny_checkpoint(root / "d", seed=2)
    return init_cluster(root / "c", target=pair[0], draft=pair[1])


def test_a_variant_is_a_name_and_its_settings():
    assert parse_variant("b2: lane.speculate_branches=2") == (
        "b2",
        {"lane.speculate_branches": "2"},
    )
    assert parse_variant("nopin:proposer.cpus=none  verifier.cpus=none") == (
        "nopin",
        {"proposer.cpus": "none", "verifier.cpus": "none"},
    )


@pytest.mark.parametrize(
    "text, says",
    [
        ("lane.speculate_branches=2", "expected 'NAME: SECTION.KEY=VALUE"),
        ("b 2: lane.draft_len=3", "expected 'NAME: SECTION.KEY=VALUE"),
        ("b2:", "no settings"),
        ("b2: speculate_branches=2", "'speculate_branches=2' is not SECTION.KEY=VALUE"),
        ("b2: tls.ca=x", "'tls.ca=x' is not SECTION.KEY=VALUE"),
        ("b2: lane.draft_len=", "'lane.draft_len=' is not SECTION.KEY=VALUE"),
    ],
)
def test_a_malformed_variant_is_refused_quoting_it(text, says):
    with pytest.raises(ValueError, match=f"--cluster-variant {text!r}: .*{says}"):
        parse_variant(text)


def _checkout(root):
    """A directory that holds every package a daemon imports (as a checkout does)."""
    for package in PACKAGES:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    return root


def test_a_variant_may_run_another_checkouts_code(tmp_path, monkeypatch):
    tree = _checkout(tmp_path / "old")
    assert parse_variant(f"old: code={tree}") == ("old", {"code": str(tree)})
    monkeypatch.chdir(tmp_path)  # a relative PATH is made absolute
    assert parse_variant("old: lane.draft_len=3 code=old") == (
        "old",
        {"lane.draft_len": "3", "code": str(tree)},
    )


@pytest.mark.parametrize("path", ["", "missing"])
def test_a_code_variant_that_is_not_a_checkout_is_refused(tmp_path, path):
    text = f"old: code={tmp_path / path if path else ''}"
    with pytest.raises(ValueError, match="is not a checkout of this project .no muser/__init__"):
        parse_variant(text)
    partial = _checkout(tmp_path / "partial")
    (partial / "wal" / "__init__.py").unlink()
    with pytest.raises(ValueError, match=r"\(no wal/__init__.py there\)"):
        parse_variant(f"old: code={partial}")


def test_a_code_variants_daemons_run_that_checkout(cluster_file, tmp_path, monkeypatch):
    """cluster_lanes: both daemons get the checkout on their PYTHONPATH, and the variant's
    other settings reach the cluster file they run from."""
    import muser_app.cli.qualify
    import muser_app.procs
    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import cluster_lanes

    started = []

    class Recorded:
        def __init__(self, role, config, log_dir, env=None):
            self.role, self.config, self.env = role, config, env

        def start(self):
            started.append((self.role, self.env, load_config(self.config)))

        def stop(self):
            pass

    monkeypatch.setattr(muser_app.procs, "Daemon", Recorded)
    tolerances = []
    monkeypatch.setattr(
        muser_app.cli.qualify, "qualify",
        lambda config, progress, tolerance=None: tolerances.append(tolerance),
    )  # fmt: skip
    config = load_config(cluster_file)
    tree = str(_checkout(tmp_path / "old"))
    settings = {"lane.speculate_branches": "1", "code": tree}
    with cluster_lanes(
        config.verifier.target, config.proposer.draft, SamplingParams(), draft_len=4,
        delays_ms=[0], settings=settings, tolerance=3e-4,
    ) as lanes:  # fmt: skip
        assert list(lanes) == ["cluster@0ms"]
    assert tolerances == [3e-4]  # bench --qualify-tolerance reaches the qualification
    assert [(role, env) for role, env, _ in started] == [
        ("verifier", {"PYTHONPATH": tree}),
        ("proposer", {"PYTHONPATH": tree}),
    ]
    assert all(c.lane.speculate_branches == 1 for _, _, c in started)
    assert settings["code"] == tree  # the caller's settings are left as they were


def test_settings_replace_add_and_remove_lines_and_take_effect(cluster_file):
    settings = {
        "lane.speculate_branches": "3",  # replaced
        "lane.draft_len_max": "6",  # added under [lane]
        "proposer.cpus": "none",  # removed: the OS places the proposer
        "limits.max_batch": "4",
    }
    edited = cluster_file.with_name("variant.toml")  # beside the keys it names
    edited.write_text(with_settings(cluster_file.read_text(), settings))
    config = load_config(edited)
    assert config.lane.speculate_branches == 3 and config.lane.draft_len_max == 6
    assert config.proposer.cpus is None and config.limits.max_batch == 4
    base = load_config(cluster_file)
    assert config.verifier.cpus == base.verifier.cpus  # untouched
    assert base.lane.speculate_branches == "auto"  # the base file: config init's default


def test_a_setting_in_a_section_the_file_lacks_is_refused(cluster_file):
    text = cluster_file.read_text().replace("[limits]\n", "[limitz]\n")
    with pytest.raises(ValueError, match=r"no \[limits\] section \(setting limits.max_batch\)"):
        with_settings(text, {"limits.max_batch": "4"})


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cluster-variant", "b2 lane.x=1"], "expected 'NAME: SECTION.KEY=VALUE"),
        (["--cluster-variant", "old: code=/nonexistent"], "is not a checkout of this project"),
        (
            ["--cluster-variant", "a: lane.draft_len=3", "--cluster-variant", "a: lane.q_top_k=8"],
            "the name 'a' is given twice",
        ),
        (
            ["--cluster-variant", "a: lane.draft_len=3", "--cluster-delays", ""],
            "give --cluster-delays too",
        ),
        (
            ["--suite", "wal", "--cluster-variant", "a: lane.draft_len=3"],
            "--suite wal has none to compare with",
        ),
        (["--suite", "sessions", "--cluster-variant", "a lane.draft_len=3"], "expected 'NAME:"),
        (
            [
                "--suite",
                "sessions",
                "--cluster-variant",
                "a: lane.draft_len=3",
                "--cluster-variant",
                "a: lane.draft_len=2",
            ],
            "the name 'a' is given twice",
        ),
    ],
)
def test_bench_refuses_bad_variants_before_any_work(args, says, capsys, monkeypatch):
    import muser_app.fixtures

    def no_fixtures(*a, **k):
        raise AssertionError("the refusal comes first")

    monkeypatch.setattr(muser_app.fixtures, "build_fixtures", no_fixtures)
    assert main(["bench", "--no-peers", *args]) == 2
    assert says in capsys.readouterr().err


def test_the_sessions_suite_runs_a_variants_cluster_beside_the_base_one(
    tmp_path, monkeypatch, capsys
):
    """`--suite sessions --cluster-variant`: a second cluster is built with the settings,
    every wave runs on both, and the table and receipt carry the variant's rows."""
    import contextlib
    import json

    import muser_app.bench.cluster
    import muser_app.bench.sessions
    from muser_app.bench.sample import Sample

    built, used = [], []

    @contextlib.contextmanager
    def fake_cluster(target, draft, params, **kw):
        name = "b1" if kw["settings"] else "base"
        built.append((name, kw["settings"]))

        def run(prompt, max_tokens):
            used.append(name)
            return Sample(name, 0, 0, [1] * max_tokens, 0.01, 4, 2, 2, {})

        run.cpus = {"proposer": [0], "verifier": [1]} if name == "base" else {"proposer": None}
        yield {"cluster@0ms": run}

    seen = {}

    def summarise(rates, samples, oracle, cores=None):
        seen["cores"] = cores
        return real_summarise(rates, samples, oracle, cores)

    real_summarise = muser_app.bench.sessions.summarise_sessions
    monkeypatch.setattr(muser_app.bench.sessions, "summarise_sessions", summarise)
    monkeypatch.setattr(muser_app.bench.cluster, "cluster_lanes", fake_cluster)
    receipt = tmp_path / "r.json"
    code = main(["bench", "--suite", "sessions", "--sessions", "1,2", "--temperature", "1",
                 "--max-tokens", "3", "--repeats", "2", "--receipt", str(receipt),
                 "--cluster-variant", "b1: lane.speculate_branches=1"])  # fmt: skip
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err
    assert built == [("base", None), ("b1", {"lane.speculate_branches": "1"})]
    assert seen["cores"] == {"": {"proposer": 1, "verifier": 1}}  # b1's proposer: not pinned
    assert used.count("base") == used.count("b1") == 1 + 2 * (1 + 2)  # warm-up, 2 × (N=1, N=2)
    assert "×base" in out.splitlines()[0] and any(
        line.split()[0] == "2[b1]" for line in out.splitlines()[1:]
    )
    data = json.loads(receipt.read_text())
    assert data["meta"]["cluster_variants"] == {"b1": {"lane.speculate_branches": "1"}}
    assert sorted(data["meta"]["rates_tokens_per_s"]) == [
        "sessions=1", "sessions=1[b1]", "sessions=2", "sessions=2[b1]"
    ]  # fmt: skip
    assert data["summary"]["sessions=2[b1]"]["ratio_to_base"] > 0


def test_the_lanes_suite_reads_each_cluster_lanes_round_trip(tmp_path, monkeypatch, capsys):
    """The round trip `cluster_lanes` injected under a lane reaches the summary: the lane
    behind 20 ms gets its wire bounds in the receipt, the one at 0 ms none; and each lane's
    pinned CPUs reach it too."""
    import contextlib
    import json

    import muser_app.bench.cluster
    import muser_app.bench.run
    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import AHEAD

    def stream(address, prompt, params, draft_len):
        n = params.max_tokens
        return {"tokens": [1] * n, "stats": {"drafted": 4, "accepted": 2, "rounds": 2,
                                             "split_s": {"draft": 0.001, "verify": 0.002},
                                             "speculation": dict.fromkeys(AHEAD, 0)}}  # fmt: skip

    @contextlib.contextmanager
    def fake_cluster(target, draft, params, **kw):
        lanes = {}
        for d in kw["delays_ms"]:  # the bench's own lane, over a fake stream
            lanes[f"cluster@{d:g}ms"] = muser_app.bench.cluster._lane(stream, "a", params, 4, {},
                                                                  None, d / 1000)  # fmt: skip
            lanes[f"cluster@{d:g}ms"].cpus = {"proposer": [0], "verifier": [1, 2]}
        yield lanes

    assert muser_app.bench.cluster._lane(stream, "a", SamplingParams(), 4, {}).rtt_s == 0.0
    seen = {}

    def summarise(samples, rtt_s=None, cores=None, **kw):
        seen["cores"], seen["sampled"] = cores, kw.get("sampled")
        return real_summarise(samples, rtt_s, cores, **kw)

    real_summarise = muser_app.bench.run.summarise
    monkeypatch.setattr(muser_app.bench.run, "summarise", summarise)
    monkeypatch.setattr(muser_app.bench.cluster, "cluster_lanes", fake_cluster)
    receipt = tmp_path / "r.json"
    code = main(["bench", "--no-peers", "--prompts", "1", "--max-tokens", "3", "--repeats", "1",
                 "--cluster-delays", "0,20", "--receipt", str(receipt)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    summary = json.loads(receipt.read_text())["summary"]
    assert summary["cluster@20ms"]["rtt_ms"] == pytest.approx(20.0)
    assert summary["cluster@20ms"]["wire_bound_tokens_per_s"] == pytest.approx(3 / (2 * 0.02))
    assert "wire_bound_tokens_per_s" not in summary["cluster@0ms"]
    assert seen["cores"] == {  # each daemon's CPU count, for the core bound
        name: {"proposer": 1, "verifier": 2} for name in ("cluster@0ms", "cluster@20ms")
    }
    assert seen["sampled"] is False
    code = main(["bench", "--no-peers", "--prompts", "1", "--max-tokens", "3", "--repeats", "1",
                 "--cluster-delays", "0", "--temperature", "1",
                 "--receipt", str(receipt)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert seen["sampled"] is True  # T > 0: held to the local lane
    summary = json.loads(receipt.read_text())["summary"]
    assert "sampled_match_local" in summary["cluster@0ms"]
