"""Real daemons (subprocesses on loopback, the fixture pair): generate, then scrape both
/metrics endpoints and `muser status --json`, and read the JSON log lines."""

from __future__ import annotations

import json
import urllib.request

import pytest

from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import stream_generate
from tests.cluster.conftest import make_cluster
from tests.cluster.harness import muser
from tests.metrics.test_exporter import samples


@pytest.fixture
def json_cluster(tmp_path, fixture_pair, monkeypatch):
    """Both daemons with `http` set (as `muser config init` writes), JSON log lines, and the
    per-round DEBUG lines."""
    monkeypatch.setenv("MUSER_LOG_FORMAT", "json")
    monkeypatch.setenv("MUSER_LOG_LEVEL", "debug")
    c = make_cluster(tmp_path, fixture_pair)
    assert c.config.verifier.http and c.config.proposer.http
    if not c.config.lane.receipt.exists():  # the verifier serves a qualified lane only
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(json.dumps("def main(args):\n") + "\n")
        out = muser("qualify", "--config", str(c.config_path), "--prompts", str(prompts))
        assert out.returncode == 0, out.stdout + out.stderr
    c.start()
    yield c
    c.stop()


def scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        assert resp.status == 200
        return samples(resp.read())


def test_metrics_status_and_logs_of_a_live_cluster(json_cluster):
    c = json_cluster
    runs = [
        stream_generate(c.address, "def main(args):\n", SamplingParams(max_tokens=40)),
        stream_generate(
            c.address,
            "import os\n",
            SamplingParams(temperature=1.0, max_tokens=32, seed=7),
        ),
    ]
    received = sum(len(r["tokens"]) for r in runs)
    assert received == 72
    client_rounds = sum(r["stats"]["rounds"] for r in runs)

    p = scrape(c.config.proposer.http)
    v = scrape(c.config.verifier.http)
    assert p[("muser_emitted_tokens_total", ())] == received
    assert p[("muser_rounds_total", ())] == client_rounds
    assert v[("muser_rounds_total", ())] >= p[("muser_rounds_total", ())]
    assert v[("muser_emitted_tokens_total", ())] >= received
    assert p[("muser_tokens_per_round_sum", ())] == received
    for got in (p, v):
        assert 0.0 <= got[("muser_acceptance_ratio", ())] <= 1.0
        assert got[("muser_wal_fsync_seconds_count", ())] > 0
        assert got[("muser_wal_bytes", ())] > 0
        assert got[("muser_verifier_ceiling_tokens_per_second", ())] > 0
    for phase in ("draft", "transport", "verify", "wal", "sign"):
        assert p[("muser_round_phase_seconds_count", (("phase", phase),))] == client_rounds
    assert p[("muser_info", (("key_id", _key(c, "proposer")), ("role", "proposer")))] == 1

    out = muser("status", "--config", str(c.config_path), "--json", timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    for role in ("verifier", "proposer"):
        status = report[role]["status"]
        assert status["open_sessions"] == 0, status
        assert 0.0 <= status["acceptance"] <= 1.0 and status["tokens_per_s"] > 0
        wal = status["wal"]
        assert wal["bytes"] > 0 and wal["fsyncs"] > 0
        assert 0 < wal["fsync_p50_s"] <= wal["fsync_p99_s"]
    assert report["proposer"]["status"]["emitted"] == received
    assert report["proposer"]["status"]["sessions"] == 2
    assert report["verifier"]["status"]["closed_sessions"] == 2  # the proposer closed both
    text = muser("status", "--config", str(c.config_path), timeout=60)
    assert "fsync p50" in text.stdout and "acceptance" in text.stdout, text.stdout

    sessions = {r["session_id"] for r in runs}
    round_lines = [
        entry
        for line in c.verifier.log_path.read_text().splitlines()
        if line.startswith("{") and "round" in (entry := json.loads(line))
    ]
    assert {e["session"] for e in round_lines} == sessions
    committed = [e for e in round_lines if "accepted" in e["message"]]
    assert len(committed) == v[("muser_rounds_total", ())]


def _key(c, role: str) -> str:
    from muser import keys

    return keys.key_id(keys.load_public(getattr(c.config, role).public_key))
