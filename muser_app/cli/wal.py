"""`muser wal inspect|verify|repair DIR`: look at, check and fix a commit-log directory.

Exit codes: 0 all good; 1 verify found a failure (named on stderr); 2 refused (not a
directory, a directory without segment files, an unreadable key file or one that is no
Ed25519 public key, an --interpreter that cannot be loaded, a format version this build
cannot read).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DAEMON_INTERPRETERS: tuple[str, ...] = (
    "verifier_gx.journal_check:WalInterpreter",
    "proposer_mac.journal:WalInterpreter",
)
"""The daemons' record interpreters (wal/interpret.py), loaded by every `muser wal` command."""


def register(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__)
    actions = parser.add_subparsers(dest="wal_action", metavar="ACTION")
    parser.set_defaults(func=lambda args: _usage(parser))

    inspect = actions.add_parser(
        "inspect", help="segments, record counts, sequence range, sessions and heads, torn tail"
    )
    inspect.add_argument(
        "directory",
        type=Path,
        metavar="DIR",
        help="a log directory: the verifier's WAL_DIR/commit or the proposer's WAL_DIR/journal",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    _interpreter_arg(inspect)
    inspect.set_defaults(func=cmd_inspect)

    verify = actions.add_parser(
        "verify", help="check every checksum, hash chain and (given keys) signature"
    )
    verify.add_argument(
        "directory",
        type=Path,
        metavar="DIR",
        help="a log directory: the verifier's WAL_DIR/commit or the proposer's WAL_DIR/journal",
    )
    verify.add_argument(
        "--pubkey",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a public key file handed to the record interpreters (repeatable)",
    )
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    _interpreter_arg(verify)
    verify.set_defaults(func=cmd_verify)

    repair = actions.add_parser(
        "repair", help="keep every record before the first bad one, move the rest to quarantine/"
    )
    repair.add_argument(
        "directory",
        type=Path,
        metavar="DIR",
        help="a log directory: the verifier's WAL_DIR/commit or the proposer's WAL_DIR/journal",
    )
    repair.add_argument("--json", action="store_true", help="print one JSON object")
    repair.set_defaults(func=cmd_repair)


def _interpreter_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interpreter",
        action="append",
        default=[],
        metavar="MODULE[:ATTR]",
        help="import a record interpreter (see wal/interpret.py) besides the built-in ones",
    )


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def cmd_inspect(args: argparse.Namespace) -> int:
    from wal.interpret import load_interpreters
    from wal.tools import inspect_log

    load_interpreters(DAEMON_INTERPRETERS, args.interpreter)
    report = inspect_log(args.directory)
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(format_inspect(report))
    return 0


def format_inspect(report: dict) -> str:
    """The inspect report for a person: one line per file, then the totals."""
    lines = [f"{report['directory']}:"]
    for seg in report["segments"]:
        lines.append(
            f"  {seg['file']}  seq {seg['first_seq']}..{seg['last_seq']}  "
            f"{seg['records']} records  {seg['bytes']} bytes  {seg['status']}"
        )
    for snap in report["snapshots"]:
        lines.append(
            f"  {snap['file']}  seq {snap['seq']}  {snap['bytes']} bytes  {snap['status']}"
        )
    span = f"seq {report['first_seq']}..{report['last_seq']}" if report["records"] else "no records"
    lines.append(f"records: {report['records']} ({span})")
    torn = report["torn_tail"]
    lines.append(
        f"torn tail: {torn['file']} at byte offset {torn['offset']} ({torn['reason']}); "
        "open truncates it"
        if torn
        else "torn tail: none"
    )
    bad = report["corruption"]
    if bad:
        lines.append(
            f"CORRUPT: {bad['file']} at byte offset {bad['offset']}: {bad['reason']} "
            f"(run `muser wal repair {report['directory']}`)"
        )
    if not report["interpreters"]:
        lines.append("sessions: unknown (no record interpreter registered)")
    for sid, info in sorted(report["sessions"].items()):
        lines.append(
            f"session {sid}: {info['rounds']} rounds, last round {info['last_round']}, "
            f"head {info['head']}"
        )
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    from muser.walkeys import PubkeyFile
    from wal.errors import WalUsageError
    from wal.interpret import load_interpreters
    from wal.tools import verify_log

    keys = []
    for path in args.pubkey:
        try:
            keys.append(PubkeyFile(path.read_bytes(), path))  # a refusal names the file
        except OSError as exc:
            raise WalUsageError(f"cannot read public key file {path}: {exc}") from exc
    load_interpreters(DAEMON_INTERPRETERS, args.interpreter)
    result = verify_log(args.directory, keys)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    elif result.ok:
        checked = ", ".join(result.chain_checked_by) or "none registered"
        print(
            f"{args.directory}: OK: {result.records} records in {result.segments} segments, "
            f"{result.snapshots} snapshots; chain checked by: {checked}"
        )
        if result.torn_tail:
            print(f"note: torn tail {result.torn_tail} (the next open truncates it)")
    if not result.ok:
        print(f"muser wal verify: FAILED: {result.failure}", file=sys.stderr)
        return 1
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    from wal.repair import format_report, repair_log
    from wal.tools import require_log

    require_log(args.directory)  # before repair takes the lock: no LOCK file in a non-log
    report = repair_log(args.directory)
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
    else:
        print(format_report(report))
    return 0
