"""Pairs by name (docs/design.md §9): a target and the drafts built for it.

- `smollm2` (the default): SmolLM2-135M-Instruct, converted from its registry package
  (`fixtures.smollm2`), with a draft distilled from it here (`fixtures.smol_draft`);
- `toy`: the project's own small pair trained on the standard library's sources
  (`fixtures.build`), kept for the fast tests and as a control.

Each pair offers draft kinds: `trained` (its independent draft checkpoint), `conditioned`
(a draft reading the target's own hidden rows: `proposer_mac.backends.conditioned`, trained
by `fixtures.conditioned`, built on first use) and `ngram` (prompt lookup, no model:
`proposer_mac.backends.ngram`, on the target's tokenizer). `--target/--draft DIR`
still override a pair's files. `$MUSER_PAIR` changes the default pair (the test suite runs
on `toy` unless a test names `smollm2`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from muser.errors import RefusedError

PAIR_ENV = "MUSER_PAIR"
DEFAULT_PAIR = "smollm2"
DRAFT_KINDS = ("trained", "conditioned", "ngram")


@dataclass(frozen=True)
class PairSpec:
    name: str
    default_draft: str
    """The draft kind that measured best on this pair (docs/benchmarks.md)."""
    about: str


PAIRS = {
    "smollm2": PairSpec(
        "smollm2", "ngram", "SmolLM2-135M-Instruct (real, pretrained) and its distilled draft"
    ),
    "toy": PairSpec("toy", "trained", "the 2.4 M-parameter stdlib pair (fast tests, control)"),
}


@dataclass(frozen=True)
class PairModels:
    """What a lane runs: the target's directory and the draft's, and the draft backend a kind
    needs (`ngram` for the n-gram draft; None: the caller's choice, torch by default)."""

    pair: str
    draft_kind: str
    target: Path
    draft: Path
    draft_backend: str | None


def default_pair_name() -> str:
    name = os.environ.get(PAIR_ENV) or DEFAULT_PAIR
    return check_pair(name, f"${PAIR_ENV}")


def check_pair(name: str, where: str = "--pair") -> str:
    if name not in PAIRS:
        raise RefusedError(f"{where} {name!r} is not a pair; expected one of {', '.join(PAIRS)}")
    return name


def check_draft_kind(kind: str) -> str:
    if kind not in DRAFT_KINDS:
        raise RefusedError(
            f"--draft-kind {kind!r} is not a draft kind; expected one of {', '.join(DRAFT_KINDS)}"
        )
    return kind


def pair_target(name: str, *, progress: bool = True) -> Path:
    """The pair's target checkpoint, built (or found in the cache)."""
    if name == "toy":
        from muser_app.fixtures import build_fixtures

        return build_fixtures(progress=progress).natural.target
    from muser_app.fixtures.build import cache_dir
    from muser_app.fixtures.smollm2 import build_smollm2

    return build_smollm2(cache_dir(), progress=progress)


def pair_trained_draft(name: str, *, progress: bool = True) -> Path:
    """The pair's trained draft checkpoint, built (or found in the cache)."""
    if name == "toy":
        from muser_app.fixtures import build_fixtures

        return build_fixtures(progress=progress).natural.draft
    from muser_app.fixtures.smol_draft import build_smol_draft

    return build_smol_draft(pair_target(name, progress=progress), progress=progress)


def conditioned_recipe(name: str):
    from muser_app.fixtures.conditioned import SMOLLM2_RECIPE, TOY_RECIPE

    return TOY_RECIPE if name == "toy" else SMOLLM2_RECIPE


def pair_conditioned_draft(name: str, *, progress: bool = True) -> Path:
    """The pair's conditioned draft checkpoint, built (or found in the cache)."""
    from muser_app.fixtures.conditioned import build_conditioned

    target = pair_target(name, progress=progress)
    return build_conditioned(target, conditioned_recipe(name), progress=progress)


def resolve(
    pair: str | None,
    draft_kind: str | None,
    *,
    progress: bool = True,
    target: Path | None = None,
    draft: Path | None = None,
    need_draft: bool = True,
) -> PairModels:
    """The models a command runs: the pair's (default `default_pair_name()`), with --target
    and --draft overriding its files. Builds only what is used."""
    from proposer_mac.backends.conditioned_meta import is_conditioned

    name = check_pair(pair) if pair is not None else default_pair_name()
    if draft_kind is not None:
        kind = check_draft_kind(draft_kind)
    elif draft is not None:  # a --draft checkpoint is what it declares itself
        kind = "conditioned" if is_conditioned(draft) else "trained"
    else:
        kind = PAIRS[name].default_draft
    if kind == "ngram" and draft is not None:
        raise RefusedError(
            f"--draft {draft} names a checkpoint, but --draft-kind ngram runs no model; "
            "drop one of them"
        )
    if draft is not None and (kind == "conditioned") != is_conditioned(draft):
        what = "a conditioned draft" if is_conditioned(draft) else "not a conditioned draft"
        raise RefusedError(f"--draft {draft} is {what}, but --draft-kind {kind} was given")
    target_dir = target if target is not None else pair_target(name, progress=progress)
    if kind == "ngram":
        draft_dir, backend = target_dir, "ngram"
    elif kind == "conditioned":
        backend = "conditioned"
        if draft is not None:
            draft_dir = draft
        elif need_draft:
            draft_dir = pair_conditioned_draft(name, progress=progress)
        else:
            draft_dir = target_dir
    elif draft is not None or not need_draft:
        draft_dir, backend = draft if draft is not None else target_dir, None
    else:
        draft_dir, backend = pair_trained_draft(name, progress=progress), None
    return PairModels(name, kind, Path(target_dir), Path(draft_dir), backend)


def pair_prompts(name: str, n: int, tokenizer) -> list[str]:
    """`n` held-out natural prompts for the pair: stdlib code on the toy pair; code, prose and
    chat in turn on the real one (`fixtures.texts`)."""
    if name == "toy":
        from muser_app.fixtures import natural_prompts

        return natural_prompts(n)
    from muser_app.fixtures.texts import mixed_prompts

    return mixed_prompts(n, tokenizer)


def describe(name: str, *, progress: bool = True) -> dict:
    """A pair's paths, sizes and digests, every draft kind with its own (built if needed)."""
    from muser.identity import model_identity
    from proposer_mac.backends.ngram import NgramDraft

    target = pair_target(name, progress=progress)

    def entry(path: Path, identity, weights: bool) -> dict:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if weights else 0
        return {
            "path": str(path),
            "bytes": size,
            "model_digest": identity.model_digest,
            "tokenizer_digest": identity.tokenizer_digest,
            "architecture": identity.architecture,
        }

    from muser_app.fixtures.conditioned import find_conditioned

    trained = pair_trained_draft(name, progress=progress)
    conditioned, _, built = find_conditioned(target, conditioned_recipe(name))
    drafts = {"trained": entry(trained, model_identity(trained), True)}
    if built:  # not built here: the real pair's takes minutes (`fixtures build --conditioned`)
        drafts["conditioned"] = entry(conditioned, model_identity(conditioned), True)
    return {
        "about": PAIRS[name].about,
        "default": name == DEFAULT_PAIR,
        "default_draft": PAIRS[name].default_draft,
        "target": entry(target, model_identity(target), True),
        "drafts": {**drafts, "ngram": entry(target, NgramDraft(target).identity, False)},
    }
