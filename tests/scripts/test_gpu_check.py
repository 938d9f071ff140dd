"""`scripts/gpu_check.py`: refused at once without CUDA (exit 2, saying what to do), and the
whole script rehearsed on CPU (`--device cpu --quick`) on a tiny checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from muser_app.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MUSER_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_exits_2_saying_what_to_do(tmp_path) -> None:
    receipt = tmp_path / "r.json"
    done = run_script(tmp_path, "--receipt", str(receipt))
    assert done.returncode == 2, done.stderr
    assert "CUDA is not available on this machine" in done.stderr
    assert "pass --device cpu" in done.stderr
    assert done.stdout == "" and not receipt.exists()


def test_cpu_rehearsal_runs_every_check_and_writes_the_receipt(tmp_path) -> None:
    target = make_tiny_checkpoint(tmp_path / "t", max_position_embeddings=512)
    receipt = tmp_path / "r.json"
    args = ("--device", "cpu", "--quick", "--target", str(target), "--receipt", str(receipt))
    done = run_script(tmp_path, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    for heading in ("| contract check |", "Greedy plain decode", "Round latency"):
        assert heading in done.stdout
    r = json.loads(receipt.read_text())
    assert r["format"] == "muser.gpu-check.v1" and r["ok"] is True
    assert r["meta"]["device_label"] == "torch:cpu" and r["meta"]["tokens"] == 16
    assert len(r["contract"]) == 7 and all(c["ok"] for c in r["contract"])
    assert [e["equal"] for e in r["exactness"]] == [True]
    assert [t["D"] for t in r["timing"]] == [0, 1, 2, 4, 8]
    assert all(len(t["samples_s"]) == 3 and t["median_ms"] > 0 for t in r["timing"])
    raw = json.dumps({str(t["D"]): t["samples_s"] for t in r["timing"]}, sort_keys=True)
    assert r["samples_sha256"] == hashlib.sha256(raw.encode()).hexdigest()


def test_a_differing_greedy_token_is_reported_with_both_gaps(monkeypatch) -> None:
    """CPU against CPU never differs, so the report of a difference is checked directly."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclass looks itself up
    spec.loader.exec_module(gpu_check)
    prompt = [5, 6]
    oracle_row, device_row = np.zeros(8), np.zeros(8)
    oracle_row[[3, 4]] = [2.0, 1.99]  # the oracle prefers 3 by 0.01
    device_row[[3, 4]] = [1.99, 2.0]  # the device prefers 4 by 0.01
    same = np.arange(8.0)
    want = SimpleNamespace(tokens=[7, 3, 1], rows={2: same, 3: oracle_row, 4: same})
    got = SimpleNamespace(tokens=[7, 4, 1], rows={2: same, 3: device_row, 4: same})
    entry = gpu_check._compare(0, prompt, got, want)
    assert entry["equal"] is False
    f = entry["first_difference"]
    assert (f["index"], f["oracle_token"], f["device_token"]) == (1, 3, 4)
    for key in ("oracle_gap", "device_gap", "oracle_top2_gap", "device_top2_gap"):
        assert f[key] == pytest.approx(0.01)
    assert entry["worst_logprob_diff"] == pytest.approx(0.01, abs=1e-3)  # rows up to the split
    assert "token 1: oracle 3 (by 0.01), device 4 (by 0.01)" in gpu_check._difference(entry)
