"""The llama.cpp peer (muser_app/bench/llama_peer.py): its report is read as the tool
prints it, and a tool that is not built is a note, never silent."""

from __future__ import annotations

from pathlib import Path

import pytest

from muser_app.bench import llama_peer

REPORT = """
encoded   41 tokens in    0.120 seconds, speed:  341.667 t/s
decoded  130 tokens in    2.500 seconds, speed:   52.000 t/s

n_draft   = 4
n_predict = 130
n_drafted = 96
n_accept  = 61
accept    = 63.542%
"""


def test_the_closing_report_is_read() -> None:
    assert llama_peer.parse_report(REPORT) == (130, 2.5, 96, 61)
    lookup = "decoded 64 tokens in 1.000 seconds, speed: 64.0 t/s\nn_drafted = 10\n"
    assert llama_peer.parse_report(lookup) == (64, 1.0, 10, 0)
    with pytest.raises(RuntimeError, match="no 'decoded N tokens in S seconds' line"):
        llama_peer.parse_report("error: model not found")


def test_an_unbuilt_tool_is_a_note_naming_the_make_target(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(llama_peer.LLAMA_ENV, str(tmp_path))
    lane, note = llama_peer.llama_lane("speculative", Path("t"), Path("d"), 4, tokenizer=None)
    assert lane is None
    assert (
        note == f"skipped: {tmp_path}/build/bin/llama-speculative is not built "
        "(`make llama-env` builds it)"
    )
    lane, note = llama_peer.llama_lane("lookup", Path("t"), None, 4, tokenizer=None)
    assert lane is None and "llama-lookup is not built" in note


def test_the_bench_environments_are_looked_for_beside_the_project(monkeypatch) -> None:
    """Regression: after the layout moved the peer into muser_app/bench/, `.venv-vllm` was
    looked for inside muser_app/ and the vLLM peer was skipped as absent."""
    from muser_app.bench import vllm_peer

    root = Path(__file__).resolve().parents[2]
    assert (root / "pyproject.toml").is_file()
    assert root / ".venv-vllm" / "bin" / "python" == vllm_peer.LOCAL_PYTHON
    monkeypatch.delenv(llama_peer.LLAMA_ENV, raising=False)
    assert llama_peer.llama_dir() == root / ".llama"


def test_a_model_the_converter_cannot_read_is_a_note(tmp_path, monkeypatch) -> None:
    tool = tmp_path / "build" / "bin" / "llama-lookup"
    tool.parent.mkdir(parents=True)
    tool.write_text("")
    monkeypatch.setenv(llama_peer.LLAMA_ENV, str(tmp_path))  # no vendored converter there
    model = tmp_path / "model"
    from muser_app.testing import make_tiny_checkpoint

    make_tiny_checkpoint(model)
    lane, note = llama_peer.llama_lane("lookup", model, None, 4, tokenizer=None)
    assert lane is None
    assert note.startswith(f"skipped: convert_hf_to_gguf.py failed on {model}")
    assert not list(tmp_path.glob(".model-*.gguf*"))  # nothing half-written is left
