"""`muser qualify --config FILE`: run the lane against the non-speculative oracle on the same
target and, when it reproduces it, write the verifier-signed receipt the daemons demand
(docs/design.md §8; the receipt format is in cluster_config.qualification).

For each prompt, plain target decode (muser_app.lanes.plain) and the local lane
(muser_app.lanes.local: the cluster lane's round math and RNG protocol, in process, on the
configured target and draft backends) decode N greedy tokens. Every token must be identical
and every full target row within the tolerance in log-prob; then the acceptance over all
prompts must reach lane.acceptance_floor. A failure exits 1, writes no receipt and removes a
previous one: the lane is then unqualified until a run passes.

Prompts: by default 4 held-out natural prompts of the pair (`--pair`; by default the one
whose kind of target the cluster file names: code, prose and chat in turn for a target with a
chat template such as SmolLM2, the toy pair's stdlib code otherwise; muser_app.pairs).
`--prompts FILE` is JSONL, one prompt per line, each a JSON string or {"prompt": "..."}
(JSON because natural prompts span several lines); blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from muser.errors import RefusedError

if TYPE_CHECKING:  # heavy imports wait until the command runs (muser --help stays instant)
    from cluster_config.qualification import Evidence, Receipt
    from cluster_config.schema import ClusterConfig

DEFAULT_PROMPTS = 4
"""Fixture natural prompts decoded by default: 4 x 256 tokens take ~20 s on 2 CPU cores."""


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(
        name,
        help=help_text,
        description="Decode N greedy tokens per prompt with plain target decode and with the "
        "lane; when every token and target row matches and acceptance reaches "
        "lane.acceptance_floor, write lane.receipt signed by the verifier's key. Exit 1 when "
        "the lane fails (no receipt is left behind).",
    )
    p.add_argument("--config", type=Path, required=True, help="cluster.toml")
    p.add_argument(
        "--pair",
        default=None,
        metavar="NAME",
        help="whose held-out prompts to decode (smollm2: code, prose, chat; toy: stdlib code); "
        "default: smollm2's for a target with a chat template, else toy's",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSONL, one prompt per line: a JSON string or {"prompt": ...} '
        f"(default: {DEFAULT_PROMPTS} fixture natural prompts)",
    )
    # defaults live in cluster_config.qualification (imported when the command runs)
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="greedy tokens per prompt (default and least: 256)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest log-prob difference of any target row entry (default 1e-4)",
    )
    p.add_argument("--json", action="store_true", help="print the receipt as JSON")
    p.set_defaults(func=run)


def read_prompts(path: Path) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RefusedError(f"cannot read --prompts {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        from muser_app.cli._common import not_utf8

        raise RefusedError(not_utf8("--prompts", path, exc)) from exc
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RefusedError(f"--prompts {path}:{number}: not JSON ({exc})") from exc
        if isinstance(value, dict):
            value = value.get("prompt")
        if not isinstance(value, str) or not value:
            raise RefusedError(
                f'--prompts {path}:{number}: expected a JSON string or {{"prompt": "..."}}, '
                f"got {line[:80]!r}"
            )
        prompts.append(value)
    if not prompts:
        raise RefusedError(f"--prompts {path} holds no prompt")
    return prompts


class _SameAsOracle:
    """`on_tokens` for the lane: QualificationFailed at the first token that differs from
    plain decode's, so a broken lane fails within a round instead of after N tokens."""

    def __init__(self, oracle: Sequence[int], where: str, bar) -> None:
        self.oracle, self.where, self.bar = oracle, where, bar
        self.count = 0

    def __call__(self, tokens: list[int]) -> None:
        self.bar.update(len(tokens))
        for token in tokens:
            want = self.oracle[self.count] if self.count < len(self.oracle) else None
            if token != want:
                self.fail(token, want)
            self.count += 1

    def fail(self, got: object, want: object) -> None:
        from cluster_config.qualification import QualificationFailed

        raise QualificationFailed(
            f"{self.where}: the lane's greedy token {self.count} is "
            f"{'the end' if got is None else got}, plain decode's is "
            f"{'the end' if want is None else want}: the lane does not reproduce the target "
            "on these models"
        )


def _worst_row(lane_rows: dict, oracle_rows: dict, where: str) -> tuple[int, float]:
    """(position, largest |log p_lane - log p_oracle| over its entries) of the worst row."""
    import numpy as np

    from cluster_config.qualification import QualificationFailed

    positions = sorted(oracle_rows)
    if sorted(lane_rows) != positions:
        raise QualificationFailed(f"{where}: the lane recorded rows at other positions")

    def log_softmax(rows):
        x = np.asarray(rows, dtype=np.float64)
        m = x.max(axis=-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))

    diff = np.abs(
        log_softmax([lane_rows[k] for k in positions])
        - log_softmax([oracle_rows[k] for k in positions])
    ).max(axis=-1)
    at = int(np.argmax(diff))  # the first NaN, if any
    return positions[at], float(diff[at])


def compare_with_oracle(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    *,
    draft_len: int,
    q_top_k: int,
    tokens: int,
    tolerance: float,
    progress: bool = True,
    tree_shape: Sequence[int] = (),
) -> Evidence:
    """Decode every prompt greedily with plain decode and with the lane (its tree lane when
    `tree_shape` is given: lane.tree_nodes); the Evidence, or QualificationFailed at the
    first token that differs or target row beyond `tolerance`."""
    from tqdm import tqdm

    from cluster_config.qualification import Evidence, QualificationFailed, prompts_digest
    from muser.sampling import SamplingParams
    from muser_app.lanes.local import run_local
    from muser_app.lanes.plain import run_plain
    from muser_app.lanes.tree import run_local_tree

    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    worst, rows, drafted, accepted = 0.0, 0, 0, 0
    bar = tqdm(
        total=2 * tokens * len(prompts),
        unit="tok",
        desc="qualify",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 5.0,  # a log file gets a line per 5 s
    )
    with bar:
        for i, prompt in enumerate(prompts):
            where = f"prompt {i + 1}/{len(prompts)}"
            bar.set_postfix_str(f"{where} plain decode")
            target.reset()
            oracle = run_plain(
                target, prompt, params, record_rows=True, on_tokens=lambda t: bar.update(len(t))
            )
            bar.set_postfix_str(
                f"{where} lane " + (f"tree {tree_shape}" if tree_shape else f"D={draft_len}")
            )
            target.reset()
            draft.reset()
            watch = _SameAsOracle(oracle.tokens, where, bar)
            if tree_shape:
                lane = run_local_tree(
                    target, draft, prompt, params, branching=tree_shape, q_top_k=q_top_k,
                    record_rows=True, on_tokens=watch,
                )  # fmt: skip
            else:
                lane = run_local(
                    target, draft, prompt, params, draft_len=draft_len, q_top_k=q_top_k,
                    record_rows=True, on_tokens=watch,
                )  # fmt: skip
            if watch.count < len(oracle.tokens):  # the lane stopped early
                watch.fail(None, oracle.tokens[watch.count])
            position, diff = _worst_row(lane.rows, oracle.rows, where)
            if not diff <= tolerance:  # NaN fails too
                raise QualificationFailed(
                    f"{where}: the lane's target row at position {position} differs from "
                    f"plain decode by {diff:.3g} in log-prob, over the tolerance {tolerance:.3g}"
                )
            worst = max(worst, diff)
            rows += len(oracle.rows)
            drafted += lane.stats.drafted
            accepted += lane.stats.accepted
    return Evidence(
        prompts=len(prompts),
        prompts_digest=prompts_digest(prompts),
        tokens_per_prompt=tokens,
        tolerance=tolerance,
        rows_compared=rows,
        worst_logprob_diff=worst,
        drafted=drafted,
        accepted=accepted,
    )


def _load_backends(config: ClusterConfig) -> tuple:
    """The target as the verifier daemon loads it, the draft as the proposer daemon does."""
    from muser.identity import require_shared_vocabulary
    from proposer_mac.backends import draft_options, load_draft_backend
    from verifier_gx.backends import load_target_backend, target_options

    v, p = config.verifier, config.proposer
    target = load_target_backend(v.backend, v.target, **target_options(v))
    draft = load_draft_backend(
        p.backend, p.draft, **draft_options(p.backend, device=p.device, dtype=p.dtype)
    )
    require_shared_vocabulary(target.identity, draft.identity)
    return target, draft


def qualify(
    config: ClusterConfig,
    texts: Sequence[str] | None = None,
    *,
    tokens: int | None = None,
    tolerance: float | None = None,
    progress: bool = True,
    pair: str | None = None,
) -> Receipt:
    """Qualify `config`'s lane and write its receipt (returned) to lane.receipt, signed with
    the verifier's key; QualificationFailed (the receipt removed) when the lane fails."""
    import math

    from transformers import AutoTokenizer

    from cluster_config import qualification
    from cluster_config.qualification import MIN_TOKENS, QualificationFailed
    from muser import keys
    from muser.tree_width import shape_for_budget
    from muser_app.checks import check_config
    from muser_app.cli._common import encode_prompt
    from muser_app.pairs import check_pair, pair_prompts

    tokens = MIN_TOKENS if tokens is None else tokens
    tolerance = qualification.DEFAULT_TOLERANCE if tolerance is None else tolerance
    if tokens < MIN_TOKENS:
        raise RefusedError(f"--tokens {tokens}: qualification compares at least {MIN_TOKENS}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise RefusedError(f"--tolerance must be a finite number >= 0, got {tolerance}")
    check_config(config, receipt=False)
    binding = qualification.binding_of(config)
    tokenizer = AutoTokenizer.from_pretrained(str(config.verifier.target))
    if texts is None:
        name = pair or ("smollm2" if getattr(tokenizer, "chat_template", None) else "toy")
        texts = pair_prompts(check_pair(name), DEFAULT_PROMPTS, tokenizer)
    texts = list(texts)
    target, draft = _load_backends(config)
    for side, backend in (("target", target), ("draft", draft)):
        if backend.identity.model_digest != getattr(binding, side).model_digest:
            raise QualificationFailed(f"the {side} checkpoint changed while loading; run again")
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    lane = config.lane
    try:
        evidence = compare_with_oracle(
            target,
            draft,
            prompts,
            draft_len=lane.draft_len,
            q_top_k=lane.q_top_k,
            tokens=tokens,
            tolerance=tolerance,
            progress=progress,
            tree_shape=shape_for_budget(lane.tree_nodes, lane.draft_len),
        )
        problems = qualification.evidence_problems(evidence, lane.acceptance_floor)
        if problems:
            raise QualificationFailed("; ".join(problems))
    except QualificationFailed as exc:
        removed = Path(lane.receipt).is_file()
        Path(lane.receipt).unlink(missing_ok=True)
        raise QualificationFailed(
            f"the lane is not qualified: {exc}; no receipt written"
            + (f" (removed the previous {lane.receipt})" if removed else "")
        ) from exc
    receipt = qualification.sign(binding, evidence, keys.load_private(config.verifier.key))
    qualification.write_receipt(lane.receipt, receipt)
    return receipt


def run(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from cluster_config.qualification import to_json

    config = load_config(args.config)
    texts = read_prompts(args.prompts) if args.prompts is not None else None
    receipt = qualify(config, texts, tokens=args.tokens, tolerance=args.tolerance, pair=args.pair)
    if args.json:
        print(json.dumps({"path": str(config.lane.receipt), **to_json(receipt)}, indent=2))
        return 0
    e = receipt.evidence
    print(
        f"qualified: {e.prompts} prompts x {e.tokens_per_prompt} greedy tokens identical to "
        f"plain decode; worst target row {e.worst_logprob_diff:.2g} in log-prob (tolerance "
        f"{e.tolerance:g}); acceptance {e.acceptance:.3f} (floor "
        f"{config.lane.acceptance_floor:g})"
    )
    print(f"wrote {config.lane.receipt} (signed by verifier key {receipt.verifier_key})")
    print(f"  muser verifier serve --config {args.config}")
    return 0
