"""The local tree lane: draft and target in one process, each round a token tree (docs/design.md §3, `muser.tree`) judged after one target forward.

Per round, after the frontier f:
  1. the draft drafts the tree breadth first, one forward a depth over the tree so far
     (`TorchBackend.evaluate_tree` on its own sequence), its rows cut to q_top_k tokens
     (at T = 0 the draft's top q_top_k by probability: greedy children are its best ones);
  2. the target evaluates [f, every node] in one forward over its committed KV, each node
     seeing only its ancestors;
  3. `judge_tree` replays the drafting draws and walks the tree; the target keeps the
     accepted path's KV (`keep_path`), the draft keeps what of it it evaluated and runs the
     rest.
A round emits the accepted path and the next frontier: `tokens_per_round` in the stats is
tokens per target call. A round with no room for a draft (one token left) is a plain step.
The target must evaluate trees (torch backends do); the draft too, or be the n-gram draft,
whose rows are its lookup candidates (`NgramDraft.candidates`: no forward at all).

A feature-conditioned draft (`proposer_mac.backends.conditioned`) drafts its trees on its
own sequence, each node reading its parent's output row; the target goes through a
`CaptureTap` that keeps the root's and the accepted path's capture rows, handed to the draft
after every round. As in the local lane, its first round (no rows yet) is a plain step, and
it reads what a round committed at the start of the next tree, with the target's rows."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from muser.backend import ModelBackend, tree_evaluator, trees_on_held
from muser.mt19937 import Mt19937
from muser.round import DEFAULT_Q_TOP_K, clip_emission
from muser.sampling import SamplingParams, draft_row, target_probs
from muser.stats import LaneStats
from muser.tree import Tree, draft_tree, judge_tree, per_path, tree_depth
from muser.tree_width import FixedTree, TreePolicy
from muser.verify import judge_round
from muser_app.lanes.result import GenerationResult
from verifier_gx.capture import CaptureTap


def parse_branching(text: str) -> list[int]:
    """ "3,2,1" -> [3, 2, 1]: children per position at each depth (root first)."""
    try:
        out = [int(part) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(k < 1 for k in out):
        raise ValueError(
            f"a tree shape is children per depth, root first, each >= 1 (e.g. 3,2,1); got {text!r}"
        )
    return out


def run_local_tree(
    target: ModelBackend,
    draft: ModelBackend,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    branching: Sequence[int] = (),
    policy: TreePolicy | None = None,
    q_top_k: int = DEFAULT_Q_TOP_K,
    record_rows: bool = False,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Trees of shape `branching` every round, or of the shape `policy` chooses each round
    (`muser.tree_width`; told every round's outcome and seconds). `record_rows`: keep, for
    each emitted token, the target's row it was judged or sampled from (float64 logits; what
    qualification compares with plain decode's)."""
    lookup = hasattr(draft, "candidates")  # the n-gram draft
    conditioned = hasattr(draft, "install_features")
    if conditioned:  # the target through a tap that keeps the committed positions' rows
        draft.check_target(target.identity, "local tree lane")
        if not hasattr(target, "evaluate_tree_capture"):
            raise ValueError(
                f"the tree lane with a conditioned draft needs a target that captures a tree's "
                f"rows (torch, vLLM); {type(target).__name__} does not"
            )
        seq = target if trees_on_held(target) else target.sequence()
        target = CaptureTap(seq, draft.capture_layers)
    for name, backend in (("target", target), *(() if lookup else (("draft", draft),))):
        if not hasattr(backend, "evaluate_tree"):
            raise ValueError(
                f"the tree lane needs a {name} that evaluates token trees (torch); "
                f"{type(backend).__name__} does not"
            )
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if policy is None:
        if not branching:
            raise ValueError("the tree lane needs a shape (branching) or a tree policy")
        policy = FixedTree(list(branching))
    row_params = dataclasses.replace(params, temperature=1.0) if params.greedy else params
    stats = LaneStats(tree_shape=policy.to_dict().get("shape"))
    rows: dict = {}
    if trees_on_held(target):  # vLLM: its one held sequence, emptied
        t_seq = target
        target.reset()
    else:
        t_seq = target.sequence()
    d_seq = draft.fork() if lookup or conditioned else draft.sequence()
    d_eval = tree_evaluator(d_seq)
    if len(prompt) > 1:
        t_seq.evaluate(list(prompt[:-1]))
        if not conditioned:  # (it reads the prompt once it has the target's rows)
            d_seq.evaluate(list(prompt[:-1]))
    rng = Mt19937.from_seed(params.seed)
    frontier, out = int(prompt[-1]), []
    block = [0]  # nodes in the draft's last tree block

    def forward_rows(parents: list[int], tokens: list[int], positions: list[int]):
        logits = d_eval.evaluate_tree(d_seq, [frontier, *tokens], parents)
        block[0] = len(tokens)
        return [draft_row(logits[v], row_params, q_top_k) for v in positions]

    # the n-gram draft's rows: after the frontier and each position's path, from the tokens
    rows_at = per_path(lambda path: d_seq.candidates([frontier, *path])) if lookup else forward_rows

    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        template = policy.choose(params.max_tokens - len(out))
        if conditioned:  # before the first round's rows it drafts nothing (local.py's note)
            template = template if d_seq.ready else ()
            held = [*prompt, *out][d_seq.length : -1]  # what it has not read yet
            if template and held:
                d_seq.evaluate(held)
        tree = draft_tree(rng.copy(), template, rows_at, params.greedy) if template else None
        t1 = time.perf_counter()
        if tree is None or tree.size == 0:  # a plain step: the bonus from the frontier's row
            logits = t_seq.evaluate([frontier])
            witness = target_probs(logits, params)
            if not lookup and not conditioned:
                d_seq.evaluate([frontier])
            decision = judge_round(rng, frontier, [], [], witness, greedy=params.greedy)
            emitted, accepted, nodes, judged_at = [decision.next_frontier], 0, 0, [0]
        else:
            logits = target.evaluate_tree(t_seq, [frontier, *tree.tokens], tree.parents)
            witness = target_probs(logits, params)
            decision = judge_tree(
                rng, frontier, tree, witness, greedy=params.greedy, max_nodes=tree.size
            )
            t_seq.keep_path(decision.path)
            if conditioned:  # its path nodes read its own rows: read again with the target's
                d_seq.keep_path([])
            elif not lookup:
                _keep_draft(d_seq, tree, decision.path, block[0])
            emitted, accepted, nodes = decision.emitted(tree), decision.accepted, tree.size
            judged_at = [0, *(i + 1 for i in decision.path)]  # each emitted token's row
        if lookup:  # it holds the transcript but the new frontier
            d_seq.evaluate([frontier, *emitted[:-1]])
        if conditioned:  # the rows of the positions the round committed
            d_seq.install_features(d_seq.features_known,
                                   target.rows(d_seq.features_known, target.length))  # fmt: skip
        rng = decision.post_state
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        emission = clip_emission(emitted, len(out), params.max_tokens, params.stop_tokens)
        stats.observe_round(
            tree_depth(tree.parents) if nodes else 0, accepted, len(emission.tokens)
        )
        stats.tree_nodes += nodes
        parents, path = (tree.parents, decision.path) if nodes else ((), ())
        policy.observe(parents, path, round_s=t2 - t0)
        stats.tree_policy = policy.to_dict()
        stats.tree_shape = stats.tree_policy.get("shape")
        if record_rows:
            base = len(prompt) + len(out)
            rows.update({base + j: logits[judged_at[j]] for j in range(len(emission.tokens))})
        out += emission.tokens
        frontier = int(emitted[-1])
        if on_tokens:
            on_tokens(emission.tokens)
        if emission.done:
            break
    stats.wall_s = time.perf_counter() - start
    return GenerationResult("local-tree", "", out, len(prompt), stats, rows)


def _keep_draft(d_seq, tree: Tree, path: tuple[int, ...], in_block: int) -> None:
    """The draft's KV after the round: the frontier and the accepted path. Its last tree
    block held the nodes drafted before the deepest depth: keep what of the path is there,
    evaluate the rest."""
    held = [i for i in path if i < in_block]
    d_seq.keep_path(held)
    rest = [tree.tokens[i] for i in path[len(held) :]]
    if rest:
        d_seq.evaluate(rest)
