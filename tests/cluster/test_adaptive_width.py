"""Adaptive width on real daemons: D moves with the evidence, and the tokens stay exactly the
local lane's at the same widths (and plain decode's when greedy)."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from muser.records import RoundResult
from muser.sampling import SamplingParams
from muser.width import ScriptedWidth
from muser_app.cli.cluster_client import stream_generate
from muser_app.fixtures import natural_prompts
from muser_app.lanes.local import run_local
from muser_app.lanes.plain import run_plain
from proposer_mac import journal
from proposer_mac.backends import load_draft_backend
from tests.cluster.conftest import make_cluster
from verifier_gx.backends import load_target_backend
from wal import FileLog

RANGE = "draft_len = 4\ndraft_len_min = 0\ndraft_len_max = 8\n"
NARROW = 32
"""Draft rows this narrow accept ~1 draft in 4 at T=1 (the whole row ~3 in 4): evidence
that four drafts a round do not pay, which the adaptive width must act on."""


@pytest.fixture(scope="module")
def ranged(tmp_path_factory, fixture_pair):
    """A cluster whose lane may move D in [0, 8] (lane.width defaults to adaptive), on narrow
    draft rows."""
    c = make_cluster(
        tmp_path_factory.mktemp("ranged"),
        fixture_pair,
        edit=lambda text: re.sub(r"q_top_k = \d+", f"q_top_k = {NARROW}", text).replace(
            "draft_len = 4\n", RANGE
        ),
    )
    c.start()
    yield c
    c.stop()


def rounds_of(cluster, session_id: str) -> list[RoundResult]:
    """Every committed round of a session, from the proposer's journal (read after the
    proposer stopped: the journal is locked while it runs)."""
    with FileLog(cluster.config.proposer.wal_dir / "journal") as log:
        sessions = journal.replay(r.payload for r in log.records())
    return [RoundResult.decode(s.body) for s in sessions[bytes.fromhex(session_id)].committed]


def test_adaptive_widths_move_and_the_tokens_are_the_local_lane_at_those_widths(
    ranged, fixture_pair
):
    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    target = load_target_backend("torch", fixture_pair.target)
    draft = load_draft_backend("torch", fixture_pair.draft)
    prompt = list(tok.encode(natural_prompts(1)[0], add_special_tokens=False))
    sampled = SamplingParams(temperature=1.0, max_tokens=96, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=96)
    got_sampled = stream_generate(ranged.address, prompt, sampled)  # draft_len 0: the lane's
    got_greedy = stream_generate(ranged.address, prompt, greedy)
    fixed = stream_generate(ranged.address, prompt, sampled, draft_len=4)  # asked: fixed
    assert got_sampled["stats"]["width"]["mode"] == "adaptive"
    assert fixed["stats"]["width"] == {"mode": "fixed", "draft_len": 4}
    ranged.proposer.stop()
    try:
        widths = [len(r.drafts) for r in rounds_of(ranged, got_sampled["session_id"])]
        fixed_rounds = rounds_of(ranged, fixed["session_id"])
    finally:
        ranged.proposer.start()
    # at T=1 a narrow row accepts ~1 draft in 4: four drafts a round never pay
    assert set(widths[:-1]) != {4}, widths
    remaining = sampled.max_tokens
    for r in fixed_rounds:  # D = 4 unless fewer tokens remain
        assert len(r.drafts) == min(4, remaining - 1)
        remaining -= len(r.emitted())
    assert got_sampled["stats"]["rounds_by_draft_len"] == {
        str(d): widths.count(d) for d in sorted(set(widths))
    }
    decode_len = ranged.config.lane.decode_len
    width = ScriptedWidth(widths, decode_len)
    local = run_local(target, draft, prompt, sampled, q_top_k=NARROW, width=width)
    assert local.tokens == got_sampled["tokens"]
    target.reset()
    assert got_greedy["tokens"] == run_plain(target, prompt, greedy).tokens
