"""`muser bench --target-device`: refused before any work when the machine cannot run it, and
written into the bench cluster's verifier section (the GPU itself is exercised by
`scripts/gpu_check.py` and the device runs recorded in docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from cluster_config import load_config
from muser_app.bench.cluster import as_remote, with_target_device
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("suite", ["lanes", "sessions"])
def test_a_cuda_target_without_cuda_is_refused_before_any_work(suite, tmp_path, capsys):
    receipt = tmp_path / "r.json"
    code = main(["bench", "--suite", suite, "--target-device", "cuda", "--receipt", str(receipt)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'cuda' requested (--target-device)" in err and "pass --target-device cpu" in err
    assert not receipt.exists()


def test_a_device_torch_cannot_run_the_target_on_is_refused(tmp_path, capsys):
    code = main(["bench", "--target-device", "mps", "--receipt", str(tmp_path / "r.json")])
    assert code == 2
    assert (
        "device 'mps' refused: the torch backend runs on cpu or cuda[:N]" in capsys.readouterr().err
    )


def pair(tmp_path):
    """Two directories `config init` takes for checkpoints (what is in them is not read)."""
    for name in ("t", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return {"target": tmp_path / "t", "draft": tmp_path / "d"}


def test_the_device_lands_in_the_verifier_section_only(tmp_path):
    path = init_cluster(tmp_path, **pair(tmp_path), draft_len=4)
    text = path.read_text()
    assert with_target_device(text, "cpu") == text
    path.write_text(with_target_device(text, "cuda:1"))
    config = load_config(path)
    assert config.verifier.device == "cuda:1"
    assert path.read_text().count('device = "cuda:1"') == 1
    assert path.read_text().replace('device = "cuda:1"\n', "") == text


def test_a_delayed_verifier_runs_with_lookahead_on(tmp_path):
    path = init_cluster(tmp_path, **pair(tmp_path), draft_len=4)
    text = path.read_text()
    assert load_config(path).lane.lookahead == "auto"
    path.write_text(as_remote(text))
    assert load_config(path).lane.lookahead == "on"
    with pytest.raises(ValueError, match="no `lookahead"):
        as_remote(text.replace('lookahead = "auto"\n', ""))


def test_a_file_without_the_torch_backend_line_is_refused():
    text = '[verifier]\nbackend = "vllm"\n\n[proposer]\nbackend = "torch"\n'
    with pytest.raises(ValueError, match=r"no torch backend line in the \[verifier\] section"):
        with_target_device(text, "cuda")


def test_the_sessions_suite_runs_its_sessions_adaptive_with_a_draft_range(
    tmp_path, monkeypatch, capsys
):
    """`--suite sessions --draft-range LO:HI`: the cluster is built with that range and the
    sessions run on its adaptive lane (sessions that ask for no D), as the receipt says."""
    import contextlib
    import json

    import muser_app.bench.cluster
    from muser_app.bench.sample import Sample

    built, used = {}, []

    def lane(name):
        def run(prompt, max_tokens):
            used.append(name)
            return Sample(name, 0, 0, [1] * max_tokens, 0.01, 4, 2, 2, {})

        return run

    @contextlib.contextmanager
    def fake_cluster(target, draft, params, **kw):
        built.update(kw)
        yield {"cluster@0ms": lane("fixed"), "cluster@0ms-adaptive": lane("adaptive")}

    monkeypatch.setattr(muser_app.bench.cluster, "cluster_lanes", fake_cluster)
    receipt = tmp_path / "r.json"
    args = ["bench", "--suite", "sessions", "--sessions", "1,2", "--temperature", "1"]
    code = main([*args, "--max-tokens", "3", "--repeats", "1", "--draft-range", "0:8",
                 "--receipt", str(receipt)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert built["draft_range"] == (0, 8) and set(used) == {"adaptive"}
    assert json.loads(receipt.read_text())["meta"]["draft_range"] == [0, 8]
    used.clear()
    code = main([*args, "--max-tokens", "3", "--repeats", "1", "--receipt", str(receipt)])
    assert code == 0 and built["draft_range"] is None and set(used) == {"fixed"}
