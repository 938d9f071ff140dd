"""`muser generate` flags, watched taking effect end to end on the fixtures."""

from __future__ import annotations

import json

from muser.cli.main import main

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
