"""Speculative drafting (latency hiding): a draft made ahead on a guess, or on the
verifier's early decision, is bit-for-bit the draft made after the result, and a missed
guess or a decision the result contradicts leaves no trace on later drafts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from transformers import AutoTokenizer

from muser.mt19937 import Mt19937
from muser.round import plan_depth
from muser.sampling import SamplingParams, target_probs
from muser.verify import judge_round
from muser_app.fixtures import build_fixtures, natural_prompts
from proposer_mac.backends import load_draft_backend
from proposer_mac.drafting import Drafter
from verifier_gx.backends import load_target_backend
from verifier_gx.executor import TargetExecutor

TOKENS = 96


@pytest.fixture(scope="module")
def models():
    pair = build_fixtures(progress=False).natural
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in natural_prompts(3)]
    target = load_target_backend("torch", pair.target)
    return prompts, target, lambda: load_draft_backend("torch", pair.draft)


def run(
    target,
    drafter,
    prompt,
    params,
    *,
    speculate: bool,
    stop_early: bool = False,
    follow: str | None = None,
):
    """Rounds of the local lane; with `speculate`, every draft after the first comes from a
    speculation when its guess held. With `follow`, a missed guess is replaced by a draft on
    the round's decision ("truth"), or on a decision the result then contradicts ("lie": its
    next frontier is another token), as the driver does. Returns the proposals and (hits,
    misses)."""
    target.reset()
    executor = TargetExecutor(target)
    rng, transcript, out = Mt19937.from_seed(params.seed), list(prompt), []
    proposals, spec, hits, misses, emitted = [], None, 0, 0, None
    while len(out) < TOKENS:
        depth = plan_depth(4, TOKENS - len(out))
        if spec is not None and spec.proposal is not None and spec.emitted == emitted:
            drafter.adopt()
            proposal, hits = spec.proposal, hits + 1
        else:
            misses += spec is not None
            proposal = drafter.draft(transcript, rng, depth)
        proposals.append(proposal)
        remaining = TOKENS - len(out) - depth - 1
        spec = None
        if speculate and remaining >= 1:
            stop = threading.Event()
            if stop_early:
                stop.set()
            spec = drafter.speculate(
                transcript, rng, proposal, plan_depth(4, remaining), params.stop_tokens, stop
            )
        logits = executor.witness_logits(transcript, proposal.drafts)
        decision = judge_round(
            rng,
            transcript[-1],
            proposal.drafts,
            proposal.q_rows,
            target_probs(logits, params),
            greedy=params.greedy,
        )
        executor.settle(len(transcript), decision.accepted)
        emitted = decision.emitted(proposal.drafts)
        left = TOKENS - len(out) - len(emitted)
        if follow is not None and left >= 1:
            told = list(emitted)
            if follow == "lie":
                told[-1] = (told[-1] + 1) % target.vocab_size
            if not (spec is not None and spec.proposal is not None and spec.emitted == told):
                steps = drafter.follow_steps(
                    transcript, proposal, told, decision.post_state, plan_depth(4, left)
                )
                spec = drafter.run(steps)
        rng = decision.post_state
        out += emitted
        transcript += emitted
    return proposals, (hits, misses)


def fresh(models, prompt, params, **how):
    """`run` with a new drafter on a new draft backend."""
    _, target, load_draft = models
    return run(target, Drafter(load_draft(), params), prompt, params, **how)


def assert_same(reference, speculative):
    assert len(reference) == len(speculative)
    for i, (a, b) in enumerate(zip(reference, speculative, strict=True)):
        assert a.drafts == b.drafts, f"round {i}: drafts differ"
        for qa, qb in zip(a.q_rows, b.q_rows, strict=True):
            assert np.array_equal(qa.ids, qb.ids), f"round {i}: q ids differ"
            assert np.array_equal(qa.weights, qb.weights), f"round {i}: q weights differ"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_drafts_are_bitwise_the_drafts_made_after_the_result(models, temperature):
    prompts, target, load_draft = models
    params = SamplingParams(temperature=temperature, max_tokens=TOKENS, seed=11)
    totals = [0, 0]
    for prompt in prompts:
        reference, _ = run(target, Drafter(load_draft(), params), prompt, params, speculate=False)
        speculative, (hits, misses) = run(
            target, Drafter(load_draft(), params), prompt, params, speculate=True
        )
        assert_same(reference, speculative)
        totals[0] += hits
        totals[1] += misses
    if temperature == 0.0:  # greedy guesses hold often on the fixtures: both paths ran
        assert totals[0] > 0 and totals[1] > 0, f"hits, misses = {totals}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_on_a_decision_are_bitwise_the_drafts_made_after_the_result(models, temperature):
    prompts = models[0]
    params = SamplingParams(temperature=temperature, max_tokens=TOKENS, seed=11)
    for prompt in prompts[:2]:
        reference, _ = fresh(models, prompt, params, speculate=False)
        for speculate in (True, False):  # after a missed guess, or with no guess at all
            followed, (hits, misses) = fresh(
                models, prompt, params, speculate=speculate, follow="truth"
            )
            assert_same(reference, followed)
            assert misses == 0 and hits == len(reference) - 1  # every next draft made ahead


def test_a_decision_the_result_contradicts_leaves_the_cursor_as_a_plain_draft_would(models):
    prompts = models[0]
    params = SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=3)
    reference, _ = fresh(models, prompts[0], params, speculate=False)
    for speculate in (True, False):
        lied_to, (_, misses) = fresh(models, prompts[0], params, speculate=speculate, follow="lie")
        assert misses > 0
        assert_same(reference, lied_to)


def test_a_stopped_speculation_leaves_the_cursor_as_a_plain_draft_would(models):
    prompts = models[0]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, seed=0)
    reference, _ = fresh(models, prompts[0], params, speculate=False)
    stopped, (hits, _) = fresh(models, prompts[0], params, speculate=True, stop_early=True)
    assert hits == 0
    assert_same(reference, stopped)


def test_speculation_refuses_a_cursor_another_session_moved(models):
    prompts, _, load_draft = models
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    backend = load_draft()
    mine, other = Drafter(backend, params), Drafter(backend, params)
    state = Mt19937.from_seed(0)
    proposal = mine.draft(prompts[0], state, 4)
    other.draft(prompts[1], state, 4)  # claims the shared backend: `mine` lost its KV
    assert mine.speculate(prompts[0], state, proposal, 4, ()) is None
    again = mine.draft(prompts[0], state, 4)
    assert again.drafts == proposal.drafts


@pytest.mark.parametrize("next_depth", [1, 4])
def test_a_speculation_stopped_before_it_began_drafts_nothing(models, next_depth):
    # D = 1 drafts its only token from the first row: the stop is read before that row
    prompts, _, load_draft = models
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    drafter = Drafter(load_draft(), params)
    state = Mt19937.from_seed(0)
    proposal = drafter.draft(prompts[0], state, 4)
    stop = threading.Event()
    stop.set()
    spec = drafter.speculate(prompts[0], state, proposal, next_depth, (), stop)
    assert spec is not None and spec.proposal is None
    assert spec.emitted[:4] == proposal.drafts


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_after_following_a_rejection_starts_from_its_own_row(greedy):
    """Regression: the drafter's checkpoint (where the last real draft left its cursor) was
    matched on its length only. Drafting on a decision that rejected draft D-2 leaves the
    cursor holding another prefix of that very length; a fresh draft made then (the
    followed draft not taken: the width chose another D) restored the checkpoint's row, the
    row after the rejected draft, and drew its first draft from it. Now it drafts exactly
    as a drafter that never speculated."""
    from tests.core.fake_backend import FakeBackend

    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=1000, seed=3)
    backend = FakeBackend(order=1, salt=1)  # (its vocabulary)
    transcript, state = [3, 1, 4, 1, 5, 9, 2, 6], Mt19937.from_seed(3)
    for x in range(backend.vocab_size):
        drafter = Drafter(FakeBackend(order=1, salt=1), params)
        current = drafter.draft(transcript, state, 4)
        emitted = [*current.drafts[:2], x]  # the verifier rejected the third draft, chose x
        if x == current.drafts[2]:
            continue
        drafter.run(drafter.follow_steps(transcript, current, emitted, state, 3))
        got = drafter.draft([*transcript, *emitted], state, 2)  # not the followed depth
        want = Drafter(FakeBackend(order=1, salt=1), params).draft(
            [*transcript, *emitted], state, 2
        )
        assert got.drafts == want.drafts
        for mine, theirs in zip(got.q_rows, want.q_rows, strict=True):
            np.testing.assert_array_equal(mine.ids, theirs.ids)
            np.testing.assert_array_equal(mine.weights, theirs.weights)
