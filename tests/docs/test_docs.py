"""The documentation, held against the repository and the code it describes.

Every relative link in README.md, CONTRIBUTING.md and docs/ resolves (the file, and the
heading an anchor names); every `muser ...` command they quote parses with the CLI's own
parser; docs/configuration.md is exactly what `muser config reference` renders, so it lists
every cluster-file key and every flag; no page narrates how the work went; the benchmark page
stays one current page whose tables each carry a command and a receipt; every receipt kept is
cited and every receipt cited is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from muser_app.cli.main import build_parser
from muser_app.reference import command_flags, config_keys, render

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")])
README_MAX_LINES = 150
RECEIPT = re.compile(r"(?<![\w-])receipts/([\w.-]+\.json)")
"""A committed receipt, as pages and scripts cite it (`bench-receipts/` is the bench's
output folder, not the committed one)."""
BENCHMARKS_MAX_LINES = 500

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# How work went belongs in commit messages and issue notes: "session 37", "the ninth
# session", "issue 30" in the product's pages narrate it. Receipt file names may keep theirs.
NARRATION = re.compile(
    r"\b(session \d+|\w+(?:th|st|nd|rd) session|sessions? \d+[-–]\d+|issues? \d+)\b", re.I
)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without its fenced code blocks (links and headings live outside them)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower-case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_the_pages_exist():
    for name in ("README.md", "CONTRIBUTING.md"):
        assert (ROOT / name).is_file(), name
    for name in (
        "getting-started.md",
        "two-machines.md",
        "configuration.md",
        "api.md",
        "operations.md",
        "backends.md",
        "drafts.md",
        "reliability.md",
        "benchmarks.md",
        "design.md",
    ):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor in {dest.name})")
    assert not broken, f"{_page_id(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_nothing_points_outside_the_repository(page: Path):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text and "DESIGN.md" not in text, (
        f"{_page_id(page)} points outside the repository (../shared, DESIGN.md): the design is "
        "docs/design.md"
    )


def _joined_lines(block: str) -> list[str]:
    """A code block's lines with backslash continuations joined."""
    out, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


COMMAND_START = re.compile(r"^(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?muser\s+(.*)$")
SHELL_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}


def quoted_commands(text: str) -> list[str]:
    """The argument strings of every `muser` command a page quotes: each line of a code block
    that runs `muser` (or `.venv/bin/muser`), and each inline code span that starts with
    `muser` and names at least one flag."""
    found = []
    for block in FENCE.findall(text):
        for line in _joined_lines(block):
            m = COMMAND_START.match(line.strip())
            if m:
                found.append(" ".join(m.group(1).split()))
    for span in INLINE.findall(_prose(text)):
        m = COMMAND_START.match(span.strip())
        if m and re.search(r"(^|\s)--?[a-z]", m.group(1)):
            found.append(m.group(1))
    return found


def parse_error(args: str) -> str | None:
    """None if `muser ARGS` parses, else argparse's complaint."""
    try:
        words = shlex.split(args, comments=True)
    except ValueError as exc:
        return f"not shell words: {exc}"
    for i, word in enumerate(words):
        if word in SHELL_STOP or word.startswith((">", "2>")):
            words = words[:i]
            break
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(words)
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_quoted_command_parses(page: Path):
    bad = []
    for args in quoted_commands(page.read_text(encoding="utf-8")):
        problem = parse_error(args)
        if problem:
            bad.append(f"muser {args}: {problem}")
    assert not bad, f"{_page_id(page)} quotes commands the CLI refuses:\n" + "\n".join(bad)


def test_the_command_checker_refuses_what_the_cli_refuses():
    """The checker above is only as good as its refusals: a flag, a subcommand or a choice
    that does not exist fails it, and a command in a code block with shell around it passes."""
    assert parse_error("generate --lane plain --prompt hi") is None
    assert parse_error("bench --prompts 3 --no-peers > out.txt") is None
    assert "unrecognized arguments: --no-such-flag" in parse_error("generate --no-such-flag")
    assert "invalid choice" in parse_error("generate --lane sideways")
    assert "invalid choice" in parse_error("frobnicate")
    text = "```bash\nMUSER_LOG_LEVEL=debug .venv/bin/muser status \\\n  --config c.toml &\n```\n"
    text += "and `muser generate --lane cluster` inline, `muser status` without flags\n"
    assert quoted_commands(text) == ["status --config c.toml &", "generate --lane cluster"]


def test_the_configuration_reference_is_generated_from_the_code():
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), (
        "docs/configuration.md differs from `muser config reference`: regenerate it with "
        "`.venv/bin/muser config reference > docs/configuration.md`"
    )


def test_the_configuration_reference_lists_exactly_the_schema_keys():
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    listed, section = set(), None
    for line in text.splitlines():
        header = re.match(r"^### `\[\[?([a-z_.]+)\]\]?`$", line)
        if header:
            section = header.group(1)
        elif line.startswith("### "):
            section = None
        row = re.match(r"^\| `([a-z_]+)` \|", line)
        if section and row:
            listed.add(f"{section}.{row.group(1)}")
    keys = config_keys()
    assert {"verifier.target", "lane.draft_len", "pool.receipt", "tls.client.cert"} <= keys
    assert listed == keys, f"missing {sorted(keys - listed)}, extra {sorted(listed - keys)}"


def test_every_flag_of_every_command_says_what_it_does():
    silent = [
        f"{command} {flag}"
        for command, rows in command_flags().items()
        for flag, text in rows
        if not text.strip()
    ]
    assert not silent, f"flags without help text: {silent}"


def test_every_command_is_in_the_reference():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {c.split()[1] for c in command_flags()}
    assert listed == set(subs.choices), sorted(set(subs.choices) ^ listed)


def test_the_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    first_block = FENCE.search("\n".join(lines) + "\n")
    assert (
        first_block
        and "make demo" in first_block.group(1)
        and "make test" in (first_block.group(1))
    ), "the README opens with its two commands"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_page_narrates_the_work(page: Path):
    text = re.sub(r"[\w./-]+\.json", "", page.read_text(encoding="utf-8"))  # receipt names
    hits = sorted({m.group(0) for m in NARRATION.finditer(text)})
    assert not hits, f"{_page_id(page)} narrates work sessions or issues: {hits}"


def _sections(text: str) -> list[str]:
    return re.split(r"^#{1,6} ", text, flags=re.M)


def test_the_benchmark_page_is_current_and_every_table_has_its_command_and_receipt():
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < BENCHMARKS_MAX_LINES
    bare = []
    for section in _sections(text):
        if not re.search(r"^\|[-| :]+\|$", section, re.M):
            continue
        title = section.splitlines()[0]
        has_receipt = re.search(RECEIPT, section)
        has_command = re.search(
            r"(?:^|`)(?:\.venv\S*/)?(?:muser |python3? scripts/|make |llama-)", section, re.M
        )
        if not (has_receipt and has_command):
            bare.append(title)
    assert not bare, f"benchmark tables without a command and a receipt: {bare}"


def _cited_receipts() -> set[str]:
    cited = set()
    for path in ROOT.rglob("*"):
        hidden = any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        if path.is_file() and path.suffix in {".md", ".py"} and not hidden:
            cited |= set(re.findall(RECEIPT, path.read_text("utf-8")))
    return cited


def test_every_receipt_kept_is_cited_and_every_cited_receipt_is_kept():
    kept = {p.name for p in (DOCS / "receipts").glob("*.json")}
    cited = _cited_receipts()
    assert not cited - kept, f"cited but missing: {sorted(cited - kept)}"
    assert not kept - cited, f"kept but cited nowhere: {sorted(kept - cited)}"
