"""`muser generate` flags, watched taking effect end to end on the fixtures."""

from __future__ import annotations

import json

from muser_app.cli.main import main

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"


def generate(capsys, *flags: str, prompt: str | None = PROMPT) -> tuple[int, dict | None, str]:
    given = ["--prompt", prompt] if prompt is not None else []  # None: a held-out prompt
    code = main(["generate", *given, "--max-tokens", "16", "--json", *flags])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


def test_json_shape_and_lanes_agree(capsys):
    code, plain, _ = generate(capsys, "--lane", "plain")
    assert code == 0
    assert set(plain) == {"lane", "text", "tokens", "prompt_tokens", "stats"}
    assert {
        "rounds",
        "drafted",
        "accepted",
        "acceptance",
        "tokens_per_round",
        "wall_s",
        "tokens_per_s",
    } <= set(plain["stats"])
    _, local, _ = generate(capsys, "--lane", "local")
    assert local["tokens"] == plain["tokens"] and len(plain["tokens"]) == 16


def test_context_length_override_takes_effect(capsys):
    code, _, _ = generate(capsys, "--lane", "plain", "--context-length", "2048")
    assert code == 0
    code, _, err = generate(capsys, "--lane", "plain", "--context-length", "20")
    assert code == 2
    assert "20" in err and "context" in err


def test_a_generation_past_the_context_window_is_refused_before_any_token(capsys):
    """As the cluster's verifier refuses it at open: nothing on stdout, not a partial text
    and then an overflow."""
    for lane in ("plain", "local"):
        code = main(["generate", "--lane", lane, "--prompt", PROMPT, "--max-tokens", "16",
                     "--context-length", "30"])  # fmt: skip
        out = capsys.readouterr()
        assert code == 2 and out.out == ""
        assert "with max_tokens 16 needs" in out.err and "context window is 30" in out.err


def test_a_stop_token_outside_the_vocabulary_is_refused(capsys):
    for lane in ("plain", "local"):
        code, _, err = generate(capsys, "--lane", lane, "--stop-token", "2048")
        assert code == 2 and "stop token 2048 outside the vocabulary [0, 2048)" in err
    code, _, _ = generate(capsys, "--lane", "plain", "--stop-token", "2047")
    assert code == 0


def test_rope_theta_override_takes_effect(capsys):
    _, base, _ = generate(capsys, "--lane", "plain")
    _, changed, _ = generate(capsys, "--lane", "plain", "--rope-theta", "50")
    assert changed["tokens"] != base["tokens"]


def test_draft_window_override_takes_effect(capsys):
    flags = ["--lane", "local", "--max-tokens", "64"]
    _, full, _ = generate(capsys, *flags, prompt=None)
    _, narrow, _ = generate(capsys, *flags, "--draft-window", "2", prompt=None)
    assert narrow["tokens"] == full["tokens"]  # exactness does not move
    assert narrow["stats"]["accepted"] != full["stats"]["accepted"]  # the draft did


def test_bad_flags_are_refused_with_the_value(capsys):
    code, _, err = generate(capsys, "--temperature", "-1")
    assert code == 2 and "temperature must be a finite number >= 0, got -1.0" in err
    code, _, err = generate(capsys, "--lane", "local", "--draft-window", "0")
    assert code == 2 and "0" in err
    code, _, err = generate(capsys, "--lane", "cluster")
    assert code == 2 and "--config" in err


def test_width_flags_take_effect(capsys):
    flags = ["--lane", "local", "--max-tokens", "64", "--temperature", "1", "--seed", "3"]
    _, fixed, _ = generate(capsys, *flags, "--draft-len", "4", prompt=None)
    assert fixed["stats"]["width"] == {"mode": "fixed", "draft_len": 4}
    ranged = ["--width", "adaptive", "--draft-range", "1:8", "--draft-len", "8", "--q-top-k", "32"]
    # a draft that sees only its last token (--draft-window 1) with a 32-wide row at T=1
    # accepts ~1 draft in 4, and its drafts are as cheap as ever: eight drafts a round never
    # pay, nor three (with the whole context the draft is good enough that 3 against 1 or 2
    # turns on the machine's timing, and the policy may rightly stay at 3)
    _, adaptive, _ = generate(capsys, *flags, *ranged, "--draft-window", "1", prompt=None)
    width = adaptive["stats"]["width"]
    assert width["mode"] == "adaptive" and width["range"] == [1, 8]
    used = {int(d) for d in adaptive["stats"]["rounds_by_draft_len"]}
    assert max(used) <= 8 and min(used) < 8 and ({1, 2} & used)
    assert max(int(d) for d in fixed["stats"]["rounds_by_draft_len"]) == 4


def test_q_top_k_takes_effect(capsys):
    """The draft row's width decides how much of the draft's mass the verifier sees: the
    default (the whole row at this vocabulary) accepts far more at T=1 than 32 entries."""
    flags = ["--lane", "local", "--max-tokens", "96", "--temperature", "1", "--seed", "3"]
    _, narrow, _ = generate(capsys, *flags, "--q-top-k", "32", prompt=None)
    _, whole, _ = generate(capsys, *flags, prompt=None)
    assert narrow["stats"]["acceptance"] < 0.4 < 0.55 < whole["stats"]["acceptance"]
    code, _, err = generate(capsys, *flags, "--q-top-k", "0", prompt=None)
    assert code == 2 and "--q-top-k 0 received; expected >= 1" in err


def test_tree_nodes_takes_effect_and_is_refused_where_it_means_nothing(capsys):
    """--tree-nodes runs the local tree lane (greedy: plain decode's text) in the shape its
    budget gives, or learning among shapes with --width adaptive; it is refused with a draft
    range, on the plain and cluster lanes, and out of range."""
    flags = ["--lane", "local", "--max-tokens", "48"]
    code, tree, _ = generate(capsys, *flags, "--tree-nodes", "16", prompt=None)
    assert code == 0 and tree["lane"] == "local-tree"
    assert tree["stats"]["tree"]["shape"] == [
        4,
        4,
        4,
        4,
    ]  # nodes per depth of 4,1,1,1 and tree["stats"]["tree"]["nodes"] > 0
    _, plain, _ = generate(capsys, "--lane", "plain", "--max-tokens", "48", prompt=None)
    assert tree["tokens"] == plain["tokens"]
    code, adaptive, _ = generate(capsys, *flags, "--tree-nodes", "16", "--width", "adaptive",
                                 prompt=None)  # fmt: skip
    assert code == 0 and adaptive["tokens"] == plain["tokens"]  # any shapes: greedy is exact
    assert adaptive["stats"]["tree"]["policy"]["mode"] == "adaptive"
    for extra, says in [
        (["--draft-range", "2:6"], "it takes no --draft-range"),
        (["--tree-nodes", "0"], "--tree-nodes 0 received; expected 1 to 64"),
        (["--draft-len", "0"], "needs --draft-len (the tree's depth) in 1 to 16, got 0"),
    ]:
        code, _, err = generate(capsys, *flags, "--tree-nodes", "16", *extra, prompt=None)
        assert code == 2 and says in err, err
    code, _, err = generate(capsys, "--lane", "plain", "--tree-nodes", "16")
    assert code == 2 and "--tree-nodes is a draft flag" in err
    code, _, err = generate(capsys, "--lane", "cluster", "--tree-nodes", "16", "--config", "x")
    assert code == 2 and "--tree-nodes is not taken by --lane cluster: its lane.tree_nodes" in err


def test_width_flags_are_refused_where_they_mean_nothing(capsys):
    code, _, err = generate(
        capsys, "--lane", "local", "--width", "adaptive", "--draft-range", "5:8"
    )
    assert code == 2 and "LO <= --draft-len (4) <= HI, got '5:8'" in err
    code, _, err = generate(capsys, "--lane", "local", "--draft-range", "0:8")
    assert code == 2 and "--draft-range needs --width adaptive" in err
    code, _, err = generate(capsys, "--lane", "plain", "--width", "adaptive")
    assert code == 2 and "--lane plain drafts nothing" in err
    code, _, err = generate(capsys, "--lane", "cluster", "--width", "fixed", "--config", "x")
    assert code == 2 and "--width is not taken by --lane cluster: its lane.width" in err
    code, _, err = generate(capsys, "--lane", "cluster", "--draft-range", "1:4", "--config", "x")
    assert code == 2 and "its lane.draft_len_min and lane.draft_len_max decide" in err


def test_flags_a_lane_would_not_use_are_refused_before_any_work(capsys, monkeypatch):
    """Regression: with --lane cluster, --q-top-k, the model flags and --draft-len 0 were
    taken and did nothing (the cluster's file decides them); out-of-range numbers for the
    wire ended in a protobuf traceback. Each is refused, exit 2, before a model loads or a
    daemon is asked."""
    import muser_app.cli._common as common

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(common, "open_models", no_loading)
    cluster = ["--lane", "cluster", "--config", "unread.toml"]
    for flags, message in [
        (
            ["--q-top-k", "1"],
            "--q-top-k is not taken by --lane cluster: its lane.q_top_k in cluster.toml",
        ),
        (
            ["--target", "t"],
            "--target is not taken by --lane cluster: its verifier.target",
        ),
        (["--draft-backend", "mlx"], "--draft-backend is not taken by --lane cluster"),
        (["--draft-window", "4"], "--draft-window is not taken by --lane cluster: the proposer's"),
        (["--context-length", "64"], "--context-length is not taken by --lane cluster"),
        (["--rope-theta", "1e4"], "--rope-theta is not taken by --lane cluster"),
        (["--draft-len", "0"], "--draft-len 0 received; --lane cluster takes 1 to 64"),
        (["--draft-len", "-1"], "--draft-len -1 received"),
        (["--max-tokens", "99999999999"], "--max-tokens 99999999999 received; expected 0 to"),
        (["--top-k", "99999999999"], "--top-k 99999999999 received"),
        (["--stop-token", "-1"], "--stop-token -1 received; expected 0 to 4294967295"),
    ]:
        code, _, err = generate(capsys, *cluster, *flags)
        assert code == 2 and message in err, (flags, err)
        assert "Traceback" not in err
    for lane, flags, message in [
        ("plain", ["--q-top-k", "8"], "--q-top-k is a draft flag; --lane plain drafts nothing"),
        ("plain", ["--draft-len", "2"], "--draft-len is a draft flag"),
        ("plain", ["--draft", "d"], "--draft is a draft flag"),
        ("local", ["--config", "c.toml"], "--config is for --lane cluster; --lane local runs"),
        ("local", ["--q-top-k", "0"], "--q-top-k 0 received; expected >= 1"),
    ]:
        code, _, err = generate(capsys, "--lane", lane, *flags)
        assert code == 2 and message in err, (flags, err)
