"""`muser fixtures`: build the fixture target/draft pairs, and measure them.

muser fixtures build [--out DIR] [--force] [--pair P] [--conditioned] [--json]
muser fixtures info [--out DIR] [--json]
muser fixtures widen --factor F [--draft-factor F] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any, name: str, help_text: str) -> None:
    """Add `fixtures build`, `info` and `widen` to the top-level parser."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    sub = parser.add_subparsers(dest="fixtures_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: _usage(parser))

    build = sub.add_parser(
        "build",
        help="build (or find cached) the natural and periodic pairs; prints their paths",
        description="Train the natural pair on the stdlib sources and the periodic control "
        "pair; cached under $MUSER_CACHE_DIR/fixtures/<recipe key> (default ~/.cache/muser).",
    )
    _common(build)
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.add_argument(
        "--pair",
        choices=["all", "toy", "smollm2"],
        default="all",
        help="which pairs to build (default all: the toy pair and the periodic control, then "
        "SmolLM2 converted from its registry wheel and its distilled draft)",
    )
    build.add_argument(
        "--conditioned",
        action="store_true",
        help="also train the real pair's feature-conditioned draft (~7 min on 2 cores; the toy "
        "pair's, ~40 s, is always built; docs/conditioned.md)",
    )
    build.set_defaults(func=run_build)

    info = sub.add_parser(
        "info",
        help="measure sizes, decode costs and acceptance proxies (builds first if needed)",
    )
    _common(info)
    info.set_defaults(func=run_info)

    widen = sub.add_parser(
        "widen",
        help="write the natural pair widened F times (same logits, about F*F the arithmetic); "
        "prints their paths",
        description="Widen the natural target and draft (muser_app/fixtures/widen.py; "
        "docs/fixtures.md, 'Widened stand-ins'), written once beside the built pair. Use the "
        "paths with `muser config init --target T --draft D` or `muser generate --target T "
        "--draft D`; `muser bench --widen-target F --widen-draft F` does this itself.",
    )
    _common(widen)
    widen.add_argument("--factor", type=int, required=True, help="the target's factor (>= 1)")
    widen.add_argument(
        "--draft-factor", type=int, default=None, help="the draft's factor (default: --factor)"
    )
    widen.set_defaults(func=run_widen)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="fixture directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _paths(fx: Any) -> dict[str, str]:
    return {
        "root": str(fx.root),
        "natural_target": str(fx.natural.target),
        "natural_draft": str(fx.natural.draft),
        "periodic_target": str(fx.periodic.target),
        "periodic_draft": str(fx.periodic.draft),
    }


def run_build(args: argparse.Namespace) -> int:
    """Build or find the fixtures; print where they are."""
    from muser_app.fixtures import build_fixtures
    from muser_app.fixtures.conditioned import build_conditioned
    from muser_app.pairs import conditioned_recipe

    paths: dict[str, str] = {}
    if args.pair in ("all", "toy"):
        fx = build_fixtures(args.out, progress=True, force=args.force)
        paths |= {**_paths(fx), "key": fx.manifest()["key"]}
        paths["natural_conditioned"] = str(
            build_conditioned(fx.natural.target, conditioned_recipe("toy"), force=args.force)
        )
    if args.pair in ("all", "smollm2"):
        from muser_app.fixtures.build import cache_dir
        from muser_app.fixtures.smol_draft import build_smol_draft
        from muser_app.fixtures.smollm2 import build_smollm2

        target = build_smollm2(cache_dir(), progress=True, force=args.force)
        paths["smollm2_target"] = str(target)
        paths["smollm2_draft"] = str(build_smol_draft(target, progress=True, force=args.force))
        if args.conditioned:
            paths["smollm2_conditioned"] = str(
                build_conditioned(target, conditioned_recipe("smollm2"), force=args.force)
            )
    if args.json:
        print(json.dumps(paths, sort_keys=True))
    else:
        for label, path in paths.items():
            print(f"{label:20s} {path}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    """Measure the fixtures (the numbers docs/fixtures.md quotes)."""
    from muser_app.fixtures import build_fixtures, metrics
    from muser_app.pairs import PAIRS, describe

    fx = build_fixtures(args.out, progress=True)
    result = {**_paths(fx), **metrics(fx)}
    pairs = {name: describe(name) for name in PAIRS}
    if args.json:
        print(json.dumps({**result, "pairs": pairs}, sort_keys=True))
        return 0
    for name, pair in pairs.items():
        print(f"pair {name}{' (default)' if pair['default'] else ''}: {pair['about']}")
        for role, model in [("target", pair["target"]), *pair["drafts"].items()]:
            size = f"{model['bytes'] / 1e6:.1f} MB" if model["bytes"] else "no weights"
            print(f"  {role:8s} {size:>10s}  {model['model_digest'][:16]}  {model['path']}")
    for key, value in result.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                print(f"{key + '.' + sub:37s} {_fmt(v)}")
        else:
            print(f"{key:37s} {_fmt(value)}")
    return 0


def run_widen(args: argparse.Namespace) -> int:
    """Widen the natural pair; print where the widened checkpoints are."""
    from muser.errors import RefusedError
    from muser_app.fixtures import build_fixtures
    from muser_app.fixtures.widen import widen

    draft_factor = args.factor if args.draft_factor is None else args.draft_factor
    for flag, value in (("--factor", args.factor), ("--draft-factor", draft_factor)):
        if value < 1:  # before the fixtures are built
            raise RefusedError(f"{flag} must be >= 1, got {value}")
    pair = build_fixtures(args.out, progress=not args.json).natural
    paths = {
        "natural_target": str(widen(pair.target, args.factor)),
        "natural_draft": str(widen(pair.draft, draft_factor)),
    }
    if args.json:
        print(json.dumps(paths | {"factor": args.factor, "draft_factor": draft_factor}))
    else:
        for label, path in paths.items():
            print(f"{label:16s} {path}")
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
