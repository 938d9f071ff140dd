"""Drafting the next tree ahead (`Drafter.speculate_tree_steps`): on the guess that the
tree in flight is accepted along its first branch, the next tree is drafted while it is at
the verifier; when the guess holds, that tree is bit for bit the one drafted after the
result, and a missed guess leaves no trace on later trees."""

from __future__ import annotations

import numpy as np
import pytest

from muser.mt19937 import Mt19937
from muser.round import clip_emission
from muser.sampling import SamplingParams, target_probs
from muser.tree import Tree, judge_tree
from muser.tree_width import FixedTree
from muser.verify import judge_round
from proposer_mac.drafting import Drafter, first_branch
from tests.proposer.test_speculation import models  # noqa: F401  (the fixture pair, shared)

TOKENS = 80
SHAPE = FixedTree([3, 1, 1, 1])


def run(target, drafter: Drafter, prompt, params, *, speculate: bool, follow: bool = False):
    """Tree rounds of the local lane; with `speculate`, the next tree comes from the
    speculation whenever its guess held; with `follow` too, from a tree drafted on the
    decision (`follow_tree_steps`, as the verifier's early decision makes one) whenever the
    guess did not. Returns the proposals, the tokens and the hits (guesses and decisions)."""
    t_seq = target.sequence()
    t_seq.evaluate(prompt[:-1])
    rng, transcript, out = Mt19937.from_seed(params.seed), list(prompt), []
    proposals, spec, emitted, hits = [], None, None, 0
    while len(out) < TOKENS:
        remaining = TOKENS - len(out)
        if spec is not None and spec.proposal is not None and spec.emitted == emitted:
            drafter.adopt()
            proposal, hits = spec.proposal, hits + 1
        else:
            proposal = drafter.run(drafter.tree_steps(transcript, rng, SHAPE.choose(remaining)))
        proposals.append(proposal)
        spec = None
        if speculate and proposal.parents:
            left = remaining - len(first_branch(proposal.parents)) - 1
            if left >= 1:
                steps = drafter.speculate_tree_steps(
                    transcript, rng, proposal, SHAPE.choose(left), params.stop_tokens
                )
                spec = drafter.run(steps)
        frontier = transcript[-1]
        if proposal.parents:
            tree = Tree.from_wire(proposal.parents, proposal.drafts, proposal.q_rows)
            logits = target.evaluate_tree(t_seq, [frontier, *tree.tokens], tree.parents)
            decision = judge_tree(rng, frontier, tree, target_probs(logits, params),
                                  greedy=params.greedy, max_nodes=64)  # fmt: skip
            t_seq.keep_path(decision.path)
            emitted = decision.emitted(tree)
        else:
            witness = target_probs(t_seq.evaluate([frontier]), params)
            decision = judge_round(rng, frontier, [], [], witness, greedy=params.greedy)
            emitted = [decision.next_frontier]
        clipped = clip_emission(emitted, len(out), TOKENS, params.stop_tokens).tokens
        left = remaining - len(clipped)
        guessed = spec is not None and spec.proposal is not None and spec.emitted == emitted
        if follow and proposal.parents and not guessed and left >= 1:
            steps = drafter.follow_tree_steps(
                transcript, emitted, decision.post_state, SHAPE.choose(left)
            )
            spec = drafter.run(steps)
        rng = decision.post_state
        transcript += emitted
        out += clipped
    return proposals, out, hits


def same(a, b) -> bool:
    return (
        a.drafts == b.drafts
        and a.parents == b.parents
        and len(a.q_rows) == len(b.q_rows)
        and all(
            np.array_equal(x.ids, y.ids) and np.array_equal(x.weights, y.weights)
            for x, y in zip(a.q_rows, b.q_rows, strict=True)
        )
    )


BOTH = pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=TOKENS),
     SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=4)],
    ids=["greedy", "sampled"],
)  # fmt: skip


@BOTH
def test_a_tree_drafted_ahead_is_the_tree_drafted_after_the_result(models, params):  # noqa: F811
    prompts, target, draft = models
    hits = 0
    for prompt in prompts[:2]:  # (a tree is drafted on a sequence of the draft's own)
        ahead, text, hit = run(
            target, Drafter(draft().sequence(), params), prompt, params, speculate=True
        )
        after, plain, _ = run(
            target, Drafter(draft().sequence(), params), prompt, params, speculate=False
        )
        assert text == plain
        assert len(ahead) == len(after) and all(map(same, ahead, after))
        hits += hit
    assert hits > 0  # the first branch was taken whole, and its tree used


@BOTH
def test_a_tree_drafted_on_the_decision_is_the_tree_drafted_after_the_result(
    models,  # noqa: F811
    params,
):
    """Every tree after the first comes from drafting ahead: the guess where it held, else
    a tree drafted on the round's decision, from where the guess left the draft's sequence;
    each is bit for bit the tree drafted after the result."""
    prompts, target, draft = models
    for prompt in prompts[:2]:
        ahead, text, hits = run(target, Drafter(draft().sequence(), params), prompt, params,
                                speculate=True, follow=True)  # fmt: skip
        after, plain, _ = run(
            target, Drafter(draft().sequence(), params), prompt, params, speculate=False
        )
        assert text == plain
        assert len(ahead) == len(after) and all(map(same, ahead, after))
        drafted = sum(1 for p in ahead[:-1] if p.parents)
        assert hits == drafted  # every tree after a tree was drafted ahead, and used
