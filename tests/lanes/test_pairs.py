"""Pairs by name (muser_app/pairs.py): --pair, --draft-kind and $MUSER_PAIR, watched taking
effect through the commands that pick models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muser.errors import RefusedError
from muser_app.cli.main import main
from muser_app.fixtures import build_fixtures
from muser_app.pairs import PAIR_ENV, resolve


@pytest.fixture(scope="module")
def toy():
    return build_fixtures(progress=False).natural


def test_the_default_pair_follows_the_environment(toy, monkeypatch) -> None:
    monkeypatch.setenv(PAIR_ENV, "toy")
    models = resolve(None, None)
    assert (models.pair, models.draft_kind) == ("toy", "trained")
    assert (models.target, models.draft, models.draft_backend) == (toy.target, toy.draft, None)
    monkeypatch.setenv(PAIR_ENV, "smollm2")
    real = resolve(None, None, progress=False)
    assert (real.pair, real.draft_kind, real.draft_backend) == ("smollm2", "ngram", "ngram")
    assert real.draft == real.target and (real.target / "config.json").is_file()
    assert real.target != toy.target
    monkeypatch.setenv(PAIR_ENV, "llama70b")
    with pytest.raises(RefusedError, match=r"\$MUSER_PAIR 'llama70b' is not a pair; expected"):
        resolve(None, None)


def test_draft_kinds_and_their_refusals(toy) -> None:
    ngram = resolve("toy", "ngram")
    assert (ngram.draft, ngram.draft_backend) == (toy.target, "ngram")
    assert resolve("toy", None, draft=Path("/some/draft")).draft_kind == "trained"
    with pytest.raises(RefusedError, match="--pair 'big' is not a pair; expected one of"):
        resolve("big", None)
    with pytest.raises(RefusedError, match="--draft-kind 'eagle' is not a draft kind"):
        resolve("toy", "eagle")
    with pytest.raises(RefusedError, match="--draft-kind ngram runs no model"):
        resolve("toy", "ngram", draft=toy.draft)


def generate(capsys, *flags: str) -> tuple[int, dict | None, str]:
    code = main(["generate", "--prompt", "def main():", "--max-tokens", "24", "--json", *flags])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_generate_runs_the_ngram_draft_and_stays_exact(toy, capsys) -> None:
    _, plain, _ = generate(capsys, "--lane", "plain", "--pair", "toy")
    _, trained, _ = generate(capsys, "--lane", "local", "--pair", "toy")
    _, ngram, _ = generate(capsys, "--lane", "local", "--pair", "toy", "--draft-kind", "ngram")
    assert plain["tokens"] == trained["tokens"] == ngram["tokens"]
    # the kinds draft differently: the n-gram draft proposes only after a repeat
    assert ngram["stats"]["drafted"] != trained["stats"]["drafted"]
    code, _, err = generate(
        capsys, "--lane", "local", "--pair", "toy", "--draft-kind", "ngram",
        "--draft-backend", "mlx",
    )  # fmt: skip
    assert code == 2 and "--draft-backend mlx received with the n-gram draft" in err


def test_config_init_writes_the_pairs_ngram_draft(toy, tmp_path, capsys) -> None:
    from cluster_config import load_config

    assert main(["config", "init", "--dir", str(tmp_path), "--pair", "toy",
                 "--draft-kind", "ngram"]) == 0  # fmt: skip
    config = load_config(tmp_path / "cluster.toml")
    assert config.proposer.backend == "ngram" and config.lane.acceptance_floor == 0.1
    assert Path(config.proposer.draft) == Path(config.verifier.target) == toy.target
    capsys.readouterr()
    assert main(["config", "check", str(tmp_path / "cluster.toml"), "--role", "proposer"]) == 0


def test_bench_runs_the_ngram_draft_in_every_lane(toy, tmp_path, capsys) -> None:
    receipt = tmp_path / "r.json"
    code = main(["bench", "--pair", "toy", "--draft-kind", "ngram", "--no-peers",
                 "--prompts", "1", "--max-tokens", "24", "--repeats", "1",
                 "--cluster-delays", "0", "--receipt", str(receipt)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = json.loads(receipt.read_text())
    assert (data["meta"]["pair"], data["meta"]["draft_kind"]) == ("toy", "ngram")
    assert data["meta"]["draft_backend"] == "ngram"
    summary = data["summary"]
    assert set(summary) == {"plain", "local", "cluster@0ms"}
    assert all(lane["greedy_match_plain"] == "1/1" for lane in summary.values())


def test_the_real_pairs_chat_prompts_need_a_chat_template(toy) -> None:
    from transformers import AutoTokenizer

    from muser_app.pairs import pair_prompts

    plain = AutoTokenizer.from_pretrained(str(toy.target))  # the toy tokenizer has none
    with pytest.raises(RefusedError, match="need the target's chat template.*--pair toy"):
        pair_prompts("smollm2", 3, plain)
    assert len(pair_prompts("toy", 3, plain)) == 3
