"""The width policies (muser.width): each round's D from evidence, lossless whatever it picks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cluster_config.schema import Lane
from muser.width import (
    AdaptiveWidth,
    FixedWidth,
    ScriptedWidth,
    expected_tokens,
    width_policy,
)
from proposer_mac.lane_setup import session_width
from tests.core.fake_backend import FakeBackend


def feed(policy, rounds: int, accept, *, draft_s=0.002, verify_s=0.012, overhead_s=0.008):
    """Observe `rounds` rounds at the policy's own choices; `accept(depth)` says how many of
    a round's drafts are accepted; a draftless round decodes what the policy asks. Returns
    the widths chosen."""
    chosen = []
    for _ in range(rounds):
        d = policy.choose(10_000)
        chosen.append(d)
        if d:
            a, emitted, verify = accept(d), accept(d) + 1, verify_s
        else:
            a, emitted = 0, policy.decode_len(10_000)
            verify = emitted * verify_s / 2  # one position a step, against ~5 with drafts
        draft = draft_s * d
        policy.observe(
            d, a, emitted, draft_s=draft, verify_s=verify, round_s=overhead_s + verify + draft
        )
    return chosen


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == 1.875
    assert expected_tokens(1.0, 4) == 5.0


def test_fixed_width_is_draft_len_clipped_to_what_remains():
    w = FixedWidth(4)
    assert [w.choose(r) for r in (100, 5, 3, 1)] == [4, 4, 2, 0]
    assert w.to_dict() == {"mode": "fixed", "draft_len": 4}
    with pytest.raises(ValueError, match="draft_len must be >= 0, got -1"):
        FixedWidth(-1)


def test_adaptive_widens_when_every_draft_is_accepted_and_drafting_is_cheap():
    w = AdaptiveWidth(start=2, lo=0, hi=8)
    chosen = feed(w, 40, accept=lambda d: d, draft_s=0.0005)
    assert chosen[0] == 2 and chosen[-1] == 8
    assert w.to_dict()["mode"] == "adaptive" and w.to_dict()["draft_len"] == 8


def test_adaptive_falls_to_verifier_decode_when_nothing_is_accepted_and_probes_back():
    w = AdaptiveWidth(start=4, lo=0, hi=8, decode_len_max=4, probe_every=16)
    chosen = feed(w, 40, accept=lambda d: 0)
    first_zero = chosen.index(0)
    assert first_zero <= 12  # the prior (one accept in two) fades over a few rounds
    after = chosen[first_zero:]
    # four rounds of four decoded tokens, then one probe of a single draft, again and again
    assert after[:10] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert w.decode_len(10_000) == 4 and w.decode_len(3) == 3  # never past max_tokens
    assert w.to_dict()["decode_len"] == 4


def test_decode_mode_pays_where_singleton_rounds_did_not():
    """With a heavy per-round overhead, one-token rounds lose to drafting at a poor
    acceptance, while eight decoded tokens per round win: the wire is paid once per eight."""
    costs = {"draft_s": 0.002, "verify_s": 0.012, "overhead_s": 0.03}
    poor = lambda d: 1 if d > 1 else 0  # noqa: E731  (a quarter of drafts accepted at D=4)
    singleton = AdaptiveWidth(start=4, lo=0, hi=8, decode_len_max=1)
    assert 0 not in feed(singleton, 40, poor, **costs)[10:]
    folded = AdaptiveWidth(start=4, lo=0, hi=8, decode_len_max=8)
    tail = feed(folded, 40, poor, **costs)[20:]
    assert set(tail) == {0, 1} and tail.count(0) >= 13  # 1: a probe after 16 decoded tokens


def test_adaptive_stays_within_its_range():
    w = AdaptiveWidth(start=3, lo=2, hi=5)
    assert set(feed(w, 30, accept=lambda d: 0)) == {2, 3}  # starts at 3, floors at lo
    w = AdaptiveWidth(start=3, lo=2, hi=5)
    assert max(feed(w, 30, accept=lambda d: d, draft_s=1e-5)) == 5


def test_adaptive_peek_is_what_choose_returns_after_a_full_accept():
    rng = random.Random(3)
    w = AdaptiveWidth(start=4, lo=0, hi=8)
    feed(w, 5, accept=lambda d: rng.randint(0, d))
    for _ in range(50):
        d = w.choose(10_000)
        guess = w.peek(d, 10_000)
        # a full accept, at the costs the policy already holds: peek must match
        draft, verify = w.per_draft_s * d, w.verify_s
        w.observe(
            d, d, d + 1, draft_s=draft, verify_s=verify, round_s=w.overhead_s + verify + draft
        )
        assert w.choose(10_000) == guess


def test_adaptive_needs_a_consistent_range():
    with pytest.raises(ValueError, match="expected 0 <= lo <= start <= hi, got 1 <= 0 <= 4"):
        AdaptiveWidth(start=0, lo=1, hi=4)


def test_scripted_width_replays_and_refuses_to_run_past_its_script():
    w = ScriptedWidth([3, 0, 2])
    out = []
    for _ in range(3):
        out.append(w.choose(100))
        w.observe(out[-1], 0, 1)
    assert out == [3, 0, 2]
    with pytest.raises(ValueError, match="the width script has only 3 rounds"):
        w.choose(100)
    assert ScriptedWidth([3]).choose(2) == 1  # never past max_tokens, like every policy


def test_width_policy_factory():
    assert isinstance(width_policy("adaptive", 4, 0, 8), AdaptiveWidth)
    assert width_policy("adaptive", 4, 4, 4) == FixedWidth(4)  # a range of one value is fixed
    assert width_policy("fixed", 4, 0, 8, decode_len=6) == FixedWidth(4, 6)
    with pytest.raises(ValueError, match="width mode must be 'fixed' or 'adaptive', got 'wide'"):
        width_policy("wide", 4, 0, 8)


def test_the_lane_width_knob_decides_a_session_policy():
    ranged = {"draft_len": 4, "draft_len_min": 0, "draft_len_max": 8}
    adaptive = session_width(Lane(**ranged), 0)
    assert isinstance(adaptive, AdaptiveWidth) and (adaptive.lo, adaptive.hi) == (0, 8)
    assert adaptive.start == 4
    assert adaptive.decode_len_max == 8  # lane.decode_len's default
    assert session_width(Lane(**ranged, width="fixed"), 0) == FixedWidth(4, 8)
    assert session_width(Lane(**ranged), 6) == FixedWidth(6, 8)  # a session that asks for a D
    assert session_width(Lane(draft_len=0, decode_len=5), 0) == FixedWidth(0, 5)  # no range
    assert FixedWidth(0, 5).to_dict() == {"mode": "fixed", "draft_len": 0, "decode_len": 5}
    capturing = Lane(draft_len=0, decode_len=5, capture_layers=[1])
    assert session_width(capturing, 0) == FixedWidth(0, 5)  # decode rounds capture each step


def test_the_lane_width_knob_refuses_other_values():
    with pytest.raises(ValueError, match="width"):
        Lane(width="wide")
    with pytest.raises(ValueError, match="decode_len"):
        Lane(decode_len=0)


def test_local_lane_greedy_equals_plain_whatever_the_widths():
    from muser.sampling import SamplingParams
    from muser_app.lanes.local import run_local

    target, draft = FakeBackend(), FakeBackend(order=1, salt=1)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    baseline = run_local(target, draft, [1, 2, 3], params, draft_len=4).tokens
    rng = random.Random(5)
    script = [rng.randint(0, 6) for _ in range(40)]
    target.reset(), draft.reset()
    got = run_local(target, draft, [1, 2, 3], params, width=ScriptedWidth(script))
    assert got.tokens == baseline
    assert got.stats.width == {"mode": "scripted"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_rounds_emit_what_singleton_rounds_and_plain_decode_emit(temperature):
    from muser.sampling import SamplingParams
    from muser_app.lanes.local import run_local
    from muser_app.lanes.plain import run_plain

    params = SamplingParams(temperature=temperature, max_tokens=45, seed=4)
    draft = FakeBackend(order=1, salt=1)
    plain = run_plain(FakeBackend(), [1, 2, 3], params).tokens
    singleton = run_local(FakeBackend(), draft, [1, 2, 3], params, width=FixedWidth(0, 1))
    folded = run_local(FakeBackend(), draft, [1, 2, 3], params, width=FixedWidth(0, 8))
    assert singleton.tokens == plain and folded.tokens == plain
    assert (singleton.stats.rounds, folded.stats.rounds) == (45, 6)  # 5 x 8 + 5
    # a stop token ends a decode round early, and the session with it
    stop = plain[20]
    first = plain.index(stop)
    stopped = dataclasses.replace(params, stop_tokens=(stop,))
    got = run_local(FakeBackend(), draft, [1, 2, 3], stopped, width=FixedWidth(0, 8))
    assert got.tokens == plain[: first + 1]


def test_restored_rounds_count_as_evidence_but_not_as_costs():
    w = AdaptiveWidth(start=4, lo=0, hi=8)
    for _ in range(20):
        w.restore(4, 0, 1)
    assert w.alpha < 0.05 and w.overhead_s is None and w.per_draft_s is None
    assert w.choose(100) == 4  # no costs yet: it stays put until rounds are timed
    feed(w, 1, accept=lambda d: 0)
    assert w.choose(100) == 0  # the first timed round moves it at once
