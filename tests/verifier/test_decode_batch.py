"""Decode rounds of several sessions in lockstep (`verifier_gx.decode.decode_batch`): each
round emits exactly what `decode_round` emits for it alone (tokens, MT post-state, rows), a
batching target runs one forward per step for all of them, and one round's failure leaves
the others whole."""

from __future__ import annotations

import numpy as np
import pytest

from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams
from tests.core.fake_backend import FakeBackend
from verifier_gx.decode import decode_batch, decode_round
from verifier_gx.executor import TargetExecutor

SAMPLED = SamplingParams(temperature=1.0, max_tokens=64, seed=3)
PROMPTS = [[1, 2, 3], [7, 7, 9, 4, 2], [5], [11, 3, 8, 8]]


def alone(make_backend, prompt, state, k, params):
    return decode_round(TargetExecutor(make_backend()), prompt, state.copy(), k, params)


def assert_same(got, want) -> None:
    assert got.tokens == want.tokens
    assert got.post_state.to_bytes() == want.post_state.to_bytes()
    np.testing.assert_array_equal(got.logits, want.logits)


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=64)])
def test_each_round_equals_its_round_alone(params):
    states = [Mt19937.from_seed(s) for s in range(len(PROMPTS))]
    lengths = [8, 1, 5, 8]
    target = FakeBackend()  # a target that does not batch: each session on its own instance
    work = [
        (TargetExecutor(FakeBackend()), p, s.copy(), k, params)
        for p, s, k in zip(PROMPTS, states, lengths, strict=True)
    ]
    got = decode_batch(target, work)
    for g, p, s, k in zip(got, PROMPTS, states, lengths, strict=True):
        want = alone(FakeBackend, p, s, k, params)
        assert len(want.tokens) == k
        assert_same(g, want)
    assert target.evaluated == 0


def test_a_stop_token_ends_only_its_own_round():
    probe = alone(FakeBackend, PROMPTS[0], Mt19937.from_seed(0), 8, SAMPLED)
    stop = probe.tokens[2]  # the third token of prompt 0's round ends it
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=3, stop_tokens=(stop,))
    work = [(TargetExecutor(FakeBackend()), p, Mt19937.from_seed(i), 8, params)
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    got = decode_batch(FakeBackend(), work)
    assert got[0].tokens == probe.tokens[: probe.tokens.index(stop) + 1]
    for i, (g, p) in enumerate(zip(got, PROMPTS, strict=True)):
        assert_same(g, alone(FakeBackend, p, Mt19937.from_seed(i), 8, params))


def test_on_one_shared_kv_the_rounds_run_one_after_another():
    """A target that keeps one KV (no per-session sequences): each round decodes to its end
    before the next starts, so no transcript is re-evaluated between two steps."""
    shared = FakeBackend()
    lengths = [8, 5, 8, 3]
    work = [(TargetExecutor(shared), p, Mt19937.from_seed(i), k, SAMPLED)
            for i, (p, k) in enumerate(zip(PROMPTS, lengths, strict=True))]  # fmt: skip
    got = decode_batch(shared, work)
    for i, (g, p, k) in enumerate(zip(got, PROMPTS, lengths, strict=True)):
        assert_same(g, alone(FakeBackend, p, Mt19937.from_seed(i), k, SAMPLED))
    # each round: its transcript once (no shared prefix between these prompts), one token a step
    assert shared.evaluated == sum(len(p) - 1 + k for p, k in zip(PROMPTS, lengths, strict=True))


class Failing(FakeBackend):
    """Refuses its `fail_at`-th evaluate call (and every later one when `stays`)."""

    def __init__(self, fail_at: int, stays: bool) -> None:
        super().__init__()
        self.calls, self.fail_at, self.stays = 0, fail_at, stays

    def evaluate(self, tokens):
        self.calls += 1
        if self.calls == self.fail_at or (self.stays and self.calls > self.fail_at):
            raise RuntimeError("device lost")
        return super().evaluate(tokens)


def test_a_failed_step_is_retried_alone_and_the_round_is_unchanged():
    work = [(TargetExecutor(Failing(fail_at=3, stays=False)), PROMPTS[1], Mt19937.from_seed(1),
             6, SAMPLED), (TargetExecutor(FakeBackend()), PROMPTS[0], Mt19937.from_seed(0), 6,
             SAMPLED)]  # fmt: skip
    got = decode_batch(FakeBackend(), work)
    assert_same(got[0], alone(FakeBackend, PROMPTS[1], Mt19937.from_seed(1), 6, SAMPLED))
    assert_same(got[1], alone(FakeBackend, PROMPTS[0], Mt19937.from_seed(0), 6, SAMPLED))


def test_one_rounds_failure_leaves_the_others_whole():
    states = [Mt19937.from_seed(s) for s in range(3)]
    broken = TargetExecutor(Failing(fail_at=3, stays=True))
    work = [
        (TargetExecutor(FakeBackend()), PROMPTS[0], states[0].copy(), 6, SAMPLED),
        (broken, PROMPTS[1], states[1].copy(), 6, SAMPLED),
        (TargetExecutor(FakeBackend()), PROMPTS[2], states[2].copy(), 6, SAMPLED),
        (TargetExecutor(FakeBackend()), PROMPTS[3], Mt19937.from_seed(9), 0, SAMPLED),
    ]
    got = decode_batch(FakeBackend(), work)
    assert isinstance(got[1], RuntimeError) and "device lost" in str(got[1])
    assert isinstance(got[3], ValueError) and "decode_len must be >= 1, got 0" in str(got[3])
    for i in (0, 2):
        assert_same(got[i], alone(FakeBackend, PROMPTS[i], states[i], 6, SAMPLED))


@pytest.fixture(scope="module")
def torch_target(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint
    from muser_torch.backend import TorchBackend

    root = tmp_path_factory.mktemp("decode-batch-ckpt")
    return TorchBackend(make_tiny_checkpoint(root / "llama", seed=0, layers=2))


def test_a_batching_target_runs_one_forward_per_step_for_every_round(torch_target, monkeypatch):
    target = torch_target
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    forwards = []
    real = type(target).evaluate_batch
    monkeypatch.setattr(
        type(target),
        "evaluate_batch",
        lambda self, work: forwards.append(len(work)) or real(self, work),
    )
    work = [(TargetExecutor(target.sequence()), [10 + i, 20, 30 + i], Mt19937.from_seed(i), k, greedy)
            for i, k in enumerate((6, 6, 3))]  # fmt: skip
    got = decode_batch(target, work)
    # the first step also prefills each transcript (one forward per session, as witness_batch
    # holds each transcript on its own sequence), then one forward of the rounds still decoding
    assert forwards[-6:] == [3, 3, 3, 2, 2, 2]
    monkeypatch.setattr(type(target), "evaluate_batch", real)
    for (_, prompt, _, k, _), g in zip(work, got, strict=True):
        want = decode_round(
            TargetExecutor(target.sequence()), prompt, Mt19937.from_seed(0), k, greedy
        )
        assert g.tokens == want.tokens and len(g.tokens) == k
        np.testing.assert_allclose(g.logits, want.logits, atol=1e-4)


def lookup_cut(prompt, tokens, lookup) -> int:
    """How many of `tokens` a lookup round keeps: up to its first token that prompt lookup
    extends (all of them when none is)."""
    from muser.lookup import PromptLookup

    index = PromptLookup(*lookup, prompt)
    for i, token in enumerate(tokens):
        index.push(token)
        if index.proposal() is not None:
            return i + 1
    return len(tokens)


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=64)])
@pytest.mark.parametrize("lookup", [(1, 1), (1, 3), (2, 3)])
def test_a_lookup_round_is_its_decode_round_cut_at_the_first_match(params, lookup):
    """The same tokens, rows and draws as the decode round without the rule, ending after
    the first token whose sequence prompt lookup extends; lockstep rounds equal each alone."""
    cuts = []
    for seed in range(6):
        for prompt in PROMPTS:
            state = Mt19937.from_seed(seed)
            full = alone(FakeBackend, prompt, state, 16, params)
            got = decode_round(
                TargetExecutor(FakeBackend()), prompt, state.copy(), 16, params, lookup
            )
            n = lookup_cut(prompt, full.tokens, lookup)
            assert got.tokens == full.tokens[:n]
            np.testing.assert_array_equal(got.logits, full.logits[:n])
            draws = 0 if params.greedy else n  # one draw per token, as without the rule
            assert got.post_state.draws - state.draws == draws
            cuts.append(n)
    assert min(cuts) < 16  # the rule cut rounds short
    work = [(TargetExecutor(FakeBackend()), p, Mt19937.from_seed(i), 16, params, None, lookup)
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    for i, (g, p) in enumerate(zip(decode_batch(FakeBackend(), work), PROMPTS, strict=True)):
        want = decode_round(TargetExecutor(FakeBackend()), p, Mt19937.from_seed(i), 16, params,
                            lookup)  # fmt: skip
        assert_same(g, want)
