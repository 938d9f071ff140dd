"""`muser config init|check|show|reference`: write, check and print the cluster file, and
print the configuration reference."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
from pathlib import Path

from muser.round import DEFAULT_Q_TOP_K

TEMPLATE = """\
# muser-cluster: a single-machine cluster (both daemons on loopback), written by
# `muser config init`. Paths are relative to this file.

[verifier]
address = "127.0.0.1:{verifier_port}"
http = "127.0.0.1:{verifier_http_port}"
key = "keys/verifier.key"
public_key = "keys/verifier.pub"
wal_dir = "wal/verifier"
# snapshot the commit log (and drop what it covers) once this many bytes piled up; 0 = never
commit_compact_bytes = 268435456
target = "{target}"
backend = "torch"
# the torch target's forward: auto (packed where it pays: large weights reordered once for
# oneDNN on a CPU in float32, rows bit-equal on every path; else lean), packed, lean, transformers
forward = "auto"
{verifier_cpus}
[proposer]
address = "127.0.0.1:{proposer_port}"
http = "127.0.0.1:{http_port}"
key = "keys/proposer.key"
public_key = "keys/proposer.pub"
wal_dir = "wal/proposer"
# snapshot the journal (and drop what it covers) once this many bytes piled up; 0 = never
journal_compact_bytes = 268435456
draft = "{draft}"
backend = "{draft_backend}"
{proposer_cpus}
[lane]
draft_len = {draft_len}
# draft_len_min / draft_len_max: the range D may move in (default: fixed at draft_len).
# With a range, width = "adaptive" picks each round's D in it from the session's measured
# acceptance and costs (0 = singleton rounds); "fixed" keeps draft_len. Adaptive widths
# depend on timing, so a seed then pins the distribution of sampled text, not the text.
width = "adaptive"
# tokens a draftless round (D = 0) asks the verifier to decode itself
decode_len = 8
# with the n-gram draft, such a round also ends where the lookup would propose, so the next
# round drafts that match (greedy text is the same either way, sampled text has the same
# distribution)
lookup_stop = true
# token trees: each round drafts a tree of at most this many nodes, draft_len deep, judged
# in one target call (docs/trees.md); with width = "adaptive" each session learns which
# size pays (no draft, the chain, wider trees) and draws each tree best first from its
# measured acceptance; 0 = chains
tree_nodes = {tree_nodes}
q_top_k = {q_top_k}
# draft the rounds of concurrent sessions together, one batched draft forward per step
# (torch drafts; mlx and windowed drafts draft each session alone)
draft_batch = true
# greedy: while a round is away, draft the next one on full acceptance and on the rejection
# of each of the first N drafts (the draft's runner-up as the target's pick), together;
# auto: 2, or 0 with the conditioned draft (its branches measured slower than none)
speculate_branches = "auto"
# name each round drafted ahead to the verifier before its request, so it can evaluate it
# early; auto: on unless the verifier is on this machine (loopback)
lookahead = "auto"
# send round r+1's request on round r's early decision, before its signed result (journaled
# first; a result that differs voids it and r+1 is drafted again)
send_on_decision = true
# `muser qualify --config THIS_FILE` writes the receipt; the verifier refuses to serve without it
receipt = "qualification.json"
{floor_note}acceptance_floor = {acceptance_floor}

[enrolment]
verifiers = ["keys/verifier.pub"]
proposers = ["keys/proposer.pub"]

[limits]
max_sessions = 64
max_message_bytes = 8388608
max_tokens = 4096
# the proposer: finished sessions kept for clients that reconnect for the rest of a stream
finished_sessions = 1024
# the verifier: sessions whose target KV it keeps, rounds per batched forward, rounds waiting
kv_sessions = 16
max_batch = 8
round_queue = 64
# every channel and server: ping a quiet connection that has a call open after keepalive_s,
# close it when no answer comes within keepalive_timeout_s (a peer that lost power)
keepalive_s = 10.0
keepalive_timeout_s = 10.0
# the verifier: close a session nothing has opened, attached to or sent a round for in this
# long (its proposer gone for good); a proposer that comes back later is refused. 0 = never
session_idle_s = 3600.0
"""

TLS_SECTION = """
# Mutual TLS under the cluster CA in keys/tls (`muser keygen --out keys --tls`): each server
# requires a client certificate signed by tls.ca. Remove all of [tls] to run insecure.
[tls]
ca = "keys/tls/ca.pem"

[tls.verifier]
cert = "keys/tls/verifier.pem"
key = "keys/tls/verifier.key"

[tls.proposer]
cert = "keys/tls/proposer.pem"
key = "keys/tls/proposer.key"

[tls.client]
cert = "keys/tls/client.pem"
key = "keys/tls/client.key"
"""

HTTP_SECTION = """
# the HTTP endpoints (the OpenAI-compatible API, both daemons' /metrics) answer only requests
# with `Authorization: Bearer KEY` for one of these keys; others get 401
[http]
api_keys = {api_keys}
"""


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="write a working loopback cluster into DIR")
    init.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="folder to write cluster.toml, its keys and its WAL folders into",
    )
    from muser_app.cli._common import add_pair_args

    add_pair_args(init)
    init.add_argument("--target", type=Path, help="target checkpoint (default: the pair's)")
    init.add_argument("--draft", type=Path, help="draft checkpoint (default: the pair's)")
    init.add_argument(
        "--draft-backend",
        choices=["torch", "mlx"],
        default=None,
        help="a trained draft's backend (default torch; the n-gram draft has its own)",
    )
    init.add_argument(
        "--draft-len", type=int, default=4, help="lane.draft_len: drafts per round D (default 4)"
    )
    init.add_argument(
        "--tree-nodes",
        type=int,
        default=0,
        metavar="N",
        help="lane.tree_nodes: draft each round as a token tree of at most N nodes, "
        "--draft-len deep (torch draft and target; 0, the default, drafts chains)",
    )
    init.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing cluster.toml and the keys (and certificates) beside it",
    )
    init.add_argument(
        "--tls", action="store_true", help="also write a CA, certificates and the [tls] section"
    )
    init.add_argument(
        "--api-key",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on the HTTP endpoints (the OpenAI API, "
        "/metrics): writes [http] api_keys, and the file becomes readable by its owner only",
    )
    init.set_defaults(func=run_init)
    check = actions.add_parser("check", help="validate a cluster file (exit 0 ok, 2 refused)")
    check.add_argument("config", type=Path, help="the cluster file (cluster.toml) to check")
    check.add_argument(
        "--role",
        choices=["verifier", "proposer"],
        help="check only what this node's daemon needs (its own private keys); default: all",
    )
    check.set_defaults(func=run_check)
    show = actions.add_parser("show", help="print the resolved configuration (paths absolute)")
    show.add_argument("config", type=Path, help="the cluster file (cluster.toml) to print")
    show.add_argument("--json", action="store_true", help="one JSON object instead of TOML")
    show.set_defaults(func=run_show)
    reference = actions.add_parser(
        "reference",
        help="print the configuration reference (every cluster-file key and command flag) "
        "as Markdown: docs/configuration.md",
    )
    reference.set_defaults(func=run_reference)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports the kernel had free: every socket stays bound until all
    are picked, so two picks cannot land on the same port (one at a time, they can)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _cpu_lines() -> tuple[str, str]:
    """The `cpus` lines of the two nodes: the CPUs this process may use, split in two halves
    (the proposer's first), so that the draft and the target do not trade cores as they would
    not on two machines; a comment alone where there are fewer than two or none can be pinned."""
    from muser.affinity import allowed, split_for_two

    halves = split_for_two(allowed())
    if halves is None:
        note = "# cpus = [...]: the CPUs this daemon runs on (Linux); default: all it may use\n"
        return note, note
    return tuple(
        "# one machine standing for two: each daemon on its own CPUs (remove to let the OS\n"
        f"# place it)\ncpus = {_toml_value(half)}\n"
        for half in halves
    )


def init_cluster(
    directory: Path,
    *,
    target: Path | None = None,
    draft: Path | None = None,
    draft_backend: str | None = None,
    draft_len: int = 4,
    tree_nodes: int = 0,
    force: bool = False,
    pair: str | None = None,
    draft_kind: str | None = None,
    tls: bool = False,
    api_key: str | None = None,
) -> Path:
    from muser.errors import RefusedError
    from muser_app.cli.keygen import refuse_taken, write_keys

    path = directory / "cluster.toml"
    names = ["verifier", "proposer"]
    if directory.exists() and not directory.is_dir():
        raise RefusedError(f"--dir {directory} is a file; expected a directory (or a new path)")
    refuse_taken([path, *(directory / "keys" / f"{n}.key" for n in names)], force)
    if tls:
        from muser.tls import private_paths

        refuse_taken(private_paths(directory / "keys" / "tls", names), force)
    if api_key is not None:
        from cluster_config.schema import check_api_key

        try:
            check_api_key(api_key)
        except ValueError as exc:
            raise RefusedError(f"--api-key: it {exc}") from exc
    if not 0 <= draft_len <= 64:
        raise RefusedError(f"--draft-len {draft_len} received; expected 0 to 64 (lane.draft_len)")
    if not 0 <= tree_nodes <= 64:
        raise RefusedError(
            f"--tree-nodes {tree_nodes} received; expected 0 (chains) to 64 (lane.tree_nodes)"
        )
    from muser_app.cli._common import pair_models

    models = pair_models(
        argparse.Namespace(
            pair=pair, draft_kind=draft_kind, target=target, draft=draft,
            draft_backend=draft_backend,
        )
    )  # fmt: skip
    target, draft = models.target, models.draft
    draft_backend = models.draft_backend or draft_backend or "torch"
    for flag, model in (("--target", target), ("--draft", draft)):
        if not (Path(model) / "config.json").is_file():
            raise RefusedError(
                f"{flag} {model} has no config.json: expected a Hugging Face checkpoint "
                "directory (or leave it out for the fixtures)"
            )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RefusedError(f"--dir {directory}: cannot create it: {exc.strerror}") from exc
    write_keys(directory / "keys", names, force=force)
    if tls:
        from muser.tls import write_tls

        write_tls(directory / "keys" / "tls", names, force=force)
    verifier_port, verifier_http_port, proposer_port, http_port = free_ports(4)
    proposer_cpus, verifier_cpus = _cpu_lines()
    sections = TEMPLATE + (TLS_SECTION if tls else "") + (HTTP_SECTION if api_key else "")
    if api_key is not None:  # a secret in the file: only its owner reads it
        path.touch(mode=0o600)
        path.chmod(0o600)
    path.write_text(
        sections.format(
            verifier_port=verifier_port,
            verifier_http_port=verifier_http_port,
            proposer_port=proposer_port,
            http_port=http_port,
            target=Path(target).resolve(),
            draft=Path(draft).resolve(),
            draft_backend=draft_backend,
            draft_len=draft_len,
            tree_nodes=tree_nodes,
            q_top_k=DEFAULT_Q_TOP_K,
            **_floor(draft_backend),
            proposer_cpus=proposer_cpus,
            verifier_cpus=verifier_cpus,
            api_keys=_toml_value([api_key]) if api_key else "",
        )
    )
    return path


NGRAM_FLOOR = 0.1
"""The n-gram draft's qualification floor: prompt lookup proposes only after a repeat, and
how often its proposals hold depends on the text (about 0.23 on the toy pair's stdlib
prompts at D=4, docs/benchmarks.md), so 0.25 would refuse a lookup that works; a broken one
accepts nearly nothing."""


def _floor(draft_backend: str) -> dict[str, object]:
    if draft_backend != "ngram":
        return {"floor_note": "", "acceptance_floor": 0.25}
    note = (
        "# the n-gram draft (prompt lookup) accepts as often as the text repeats itself: its\n"
        "# floor only catches a lookup that is broken\n"
    )
    return {"floor_note": note, "acceptance_floor": NGRAM_FLOOR}


def run_init(args: argparse.Namespace) -> int:
    path = init_cluster(
        args.dir,
        target=args.target,
        draft=args.draft,
        draft_backend=args.draft_backend,
        draft_len=args.draft_len,
        tree_nodes=args.tree_nodes,
        force=args.force,
        tls=args.tls,
        api_key=args.api_key,
        pair=args.pair,
        draft_kind=args.draft_kind,
    )
    print(f"wrote {path}")
    print(f"  muser qualify --config {path}")
    print(f"  muser verifier serve --config {path}")
    print(f"  muser proposer serve --config {path}")
    print(f"  muser status --config {path} --wait 60")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from cluster_config import load_config
    from muser_app.checks import check_config

    check_config(load_config(args.config), role=args.role)
    print(f"{args.config}: ok" + (f" for the {args.role}" if args.role else ""))
    return 0


def resolved(config) -> dict:
    """The configuration as the daemons use it: defaults filled in, paths absolute."""
    out = config.model_dump(mode="json")
    for role in ("verifier", "proposer"):
        out[role]["bind"] = getattr(config, role).bind_address
    return out


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans read back as TOML


def to_toml(data: dict, prefix: str = "") -> str:
    """TOML for `config show`: scalars first, then each table; unset (None) values omitted."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict | None)]
    for key, value in data.items():
        if isinstance(value, dict):
            name = f"{prefix}{key}"
            lines += ["", f"[{name}]", to_toml(value, f"{name}.")]
    return "\n".join(lines).strip("\n")


def run_show(args: argparse.Namespace) -> int:
    from cluster_config import load_config

    data = resolved(load_config(args.config))
    print(json.dumps(data) if args.json else to_toml(data))
    return 0


def run_reference(args: argparse.Namespace) -> int:
    from muser_app.reference import render

    print(render(), end="")
    return 0
