"""Argument groups and model opening shared by the subcommands that run models."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from muser.errors import RefusedError
from muser.round import DEFAULT_Q_TOP_K


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (fixed per session)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    g.add_argument("--top-k", type=int, default=0, help="keep the k most probable (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seeds the session's MT19937 (default 0)")
    g.add_argument(
        "--stop-token",
        type=int,
        action="append",
        default=[],
        metavar="ID",
        help="end generation after emitting this token id (repeatable)",
    )


LOCAL_DRAFT_LEN = 4
"""D of the local lane when --draft-len is not given."""
DECODE_LEN = 8
"""Tokens a draftless round of the local lane decodes (lane.decode_len's default)."""


def add_pair_args(g) -> None:
    """--pair and --draft-kind (muser_app.pairs), on every command that picks models."""
    from muser_app.pairs import DEFAULT_PAIR, DRAFT_KINDS, PAIR_ENV, PAIRS

    g.add_argument(
        "--pair",
        default=None,
        metavar="NAME",
        help=f"the target/draft pair: {', '.join(PAIRS)} (default {DEFAULT_PAIR}, or "
        f"${PAIR_ENV}); built once and cached",
    )
    g.add_argument(
        "--draft-kind",
        default=None,
        metavar="KIND",
        help=f"which of the pair's drafts: {', '.join(DRAFT_KINDS)} (default: the pair's best "
        "measured; ngram is prompt lookup, no model)",
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models (default: the default pair, built once and cached)")
    add_pair_args(g)
    g.add_argument("--target", type=Path, help="target checkpoint directory (Hugging Face format)")
    g.add_argument("--draft", type=Path, help="draft checkpoint directory (same tokenizer)")
    g.add_argument(
        "--target-backend",
        default=None,
        choices=["torch", "vllm"],
        help="default torch; vllm needs .venv-vllm (`make vllm-env`, docs/backends.md)",
    )
    g.add_argument(
        "--draft-backend",
        default=None,
        choices=["torch", "mlx"],
        help="draft backend of a trained draft: torch (default here) or mlx (Metal on a Mac, "
        "CPU elsewhere)",
    )
    g.add_argument(
        "--draft-len",
        type=int,
        default=None,
        help="drafts per round D (default 4; with --lane cluster: the cluster's lane.draft_len)",
    )
    g.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        metavar="N",
        help="local lane: draft each round as a token tree of at most N nodes, --draft-len "
        "deep, judged in one target call (a torch, conditioned or n-gram draft; "
        "docs/trees.md); "
        "--lane cluster: the cluster's lane.tree_nodes decides",
    )
    g.add_argument(
        "--width",
        choices=["fixed", "adaptive"],
        default=None,
        help="local lane: fixed runs --draft-len every round (default); adaptive picks each "
        "round's D in --draft-range from measured acceptance and costs, starting at "
        "--draft-len (--lane cluster: the cluster's lane.width decides)",
    )
    g.add_argument(
        "--draft-range",
        default=None,
        metavar="LO:HI",
        help="the range --width adaptive moves D in (default 0:8)",
    )
    g.add_argument(
        "--draft-window",
        type=int,
        default=None,
        metavar="N",
        help="cap the context the draft attends to at the last N tokens (default: uncapped; "
        "a conditioned draft: the window its checkpoint declares)",
    )
    g.add_argument(
        "--capture-layers",
        default=None,
        metavar="I,J,K",
        help="conditioned draft: read the target's rows at these decoder layers instead of the "
        "ones its checkpoint declares (same count)",
    )
    g.add_argument(
        "--feature-dtype",
        default=None,
        choices=["float16", "float32"],
        help="conditioned draft: round the target's rows to this dtype instead of the one its "
        "checkpoint declares",
    )
    g.add_argument(
        "--q-top-k",
        type=int,
        default=None,
        help=f"draft row width: its q_top_k most probable tokens (default {DEFAULT_Q_TOP_K}; "
        "narrower rows accept less at T > 0)",
    )
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="override the context window read from the checkpoint config (both models)",
    )
    g.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="override rope_theta read from the checkpoint config (both models)",
    )


def local_tree(args: argparse.Namespace):
    """The local lane's tree policy from --tree-nodes (`muser.tree_width`: trees as deep as
    --draft-len, in the budget's shape, or learning size and shape with --width adaptive);
    None: chains."""
    from muser.tree_width import tree_policy

    if args.tree_nodes is None:
        return None
    if not 1 <= args.tree_nodes <= 64:
        raise RefusedError(f"--tree-nodes {args.tree_nodes} received; expected 1 to 64")
    if args.draft_range is not None:
        raise RefusedError("--tree-nodes drafts --draft-len deep; it takes no --draft-range")
    depth = LOCAL_DRAFT_LEN if args.draft_len is None else args.draft_len
    if not 1 <= depth <= args.tree_nodes:
        raise RefusedError(
            f"--tree-nodes {args.tree_nodes} needs --draft-len (the tree's depth) in 1 to "
            f"{args.tree_nodes}, got {depth}"
        )
    return tree_policy(args.width or "fixed", args.tree_nodes, depth)


def local_width(args: argparse.Namespace):
    """The local lane's width policy from --width/--draft-range (None: fixed at --draft-len)."""
    from muser.width import width_policy

    if args.width != "adaptive":
        if args.draft_range is not None:
            raise RefusedError("--draft-range needs --width adaptive")
        return None
    start = LOCAL_DRAFT_LEN if args.draft_len is None else args.draft_len
    lo, hi = parse_draft_range(args.draft_range or "0:8", start)
    return width_policy("adaptive", start, lo, hi, decode_len=DECODE_LEN)


def parse_draft_range(text: str, draft_len: int) -> tuple[int, int]:
    """--draft-range LO:HI, which must hold --draft-len."""
    lo, sep, hi = text.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and int(lo) <= draft_len <= int(hi)):
        raise RefusedError(
            f"--draft-range must be LO:HI with 0 <= LO <= --draft-len ({draft_len}) <= HI, "
            f"got {text!r}"
        )
    return int(lo), int(hi)


def sampling_params(args: argparse.Namespace):
    from muser.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        stop_tokens=tuple(args.stop_token),
        seed=args.seed,
    )


@dataclass
class OpenedModels:
    target: object
    draft: object | None
    tokenizer: object


def pair_models(args: argparse.Namespace, *, need_draft: bool = True, progress: bool = True):
    """The models the flags name: --pair/--draft-kind, with --target/--draft overriding the
    pair's files (muser_app.pairs.resolve); refuses --draft-backend with the n-gram draft."""
    from muser_app.pairs import resolve

    models = resolve(
        getattr(args, "pair", None),
        getattr(args, "draft_kind", None),
        progress=progress,
        target=getattr(args, "target", None),
        draft=getattr(args, "draft", None),
        need_draft=need_draft,
    )
    backend = getattr(args, "draft_backend", None)
    if models.draft_backend == "ngram" and backend not in (None, "ngram"):
        raise RefusedError(
            f"--draft-backend {backend} received with the n-gram draft, which runs no model; "
            "drop --draft-backend or choose --draft-kind trained"
        )
    return models


def open_models(args: argparse.Namespace, *, need_draft: bool) -> OpenedModels:
    """Load the target (and the draft), refusing a draft whose tokenizer differs."""
    from transformers import AutoTokenizer

    from muser.identity import require_shared_vocabulary
    from proposer_mac.backends import limit_to_target, load_draft_backend
    from verifier_gx.backends import load_target_backend

    models = pair_models(args, need_draft=need_draft, progress=sys.stderr.isatty())
    target_dir, draft_dir = models.target, models.draft
    overrides = {}
    if args.context_length is not None:
        overrides["context_length"] = args.context_length
    if args.rope_theta is not None:
        overrides["rope_theta"] = args.rope_theta
    target = load_target_backend(args.target_backend or "torch", target_dir, **overrides)
    draft = None
    if need_draft:
        if args.draft_len is None:
            args.draft_len = LOCAL_DRAFT_LEN
        if args.draft_len < 0:
            raise RefusedError(f"--draft-len must be >= 0, got {args.draft_len}")
        backend = models.draft_backend or args.draft_backend or "torch"
        if backend == "ngram":
            overrides.pop("rope_theta", None)  # no model: nothing rotates (the target's does)
        if backend == "conditioned":  # its positions and rotation are declared for the target
            overrides = conditioned_overrides(args)
        else:
            refuse_conditioned_flags(args, models.draft_kind)
        draft = load_draft_backend(backend, draft_dir, window=args.draft_window, **overrides)
        require_shared_vocabulary(target.identity, draft.identity)
        limit_to_target(draft, target.identity.vocab_size)
        if backend == "conditioned":
            draft.check_target(target.identity, f"--draft-kind conditioned ({draft_dir})")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    return OpenedModels(target, draft, tokenizer)


def conditioned_overrides(args: argparse.Namespace) -> dict[str, object]:
    """--capture-layers and --feature-dtype, as the conditioned draft's constructor takes them."""
    out: dict[str, object] = {}
    text = getattr(args, "capture_layers", None)
    if text is not None:
        try:
            out["capture_layers"] = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise RefusedError(
                f"--capture-layers {text!r}: expected decoder layer ids like 2,14,27"
            ) from None
    if getattr(args, "feature_dtype", None) is not None:
        out["feature_dtype"] = args.feature_dtype
    return out


def refuse_conditioned_flags(args: argparse.Namespace, kind: str) -> None:
    """--capture-layers / --feature-dtype mean nothing to any other draft: refused, not ignored."""
    given = [f for f in ("capture_layers", "feature_dtype") if getattr(args, f, None) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise RefusedError(f"{flags} received with the {kind} draft; they apply to "
                           "--draft-kind conditioned only")  # fmt: skip


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise RefusedError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise RefusedError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise RefusedError(not_utf8("--prompt-file", args.prompt_file, exc)) from exc
    if args.prompt is not None:
        return args.prompt
    from muser_app.fixtures import natural_prompts

    return natural_prompts(1)[0]


def not_utf8(flag: str, path: object, exc: UnicodeDecodeError) -> str:
    """The refusal of a text file that does not decode: which file, where, what is expected."""
    return (
        f"{flag} {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
        f"{exc.start}); expected a UTF-8 file: save it as UTF-8"
    )


def encode_prompt(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise RefusedError(f"the prompt {text!r} encodes to no tokens; give a non-empty prompt")
    return ids


class TextStreamer:
    """Prints decoded text as tokens arrive (decoding the whole output keeps UTF-8 whole)."""

    def __init__(self, tokenizer, out=sys.stdout) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, tokens: list[int]) -> None:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed) :])
            self.out.flush()
            self.printed = text


def stats_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
