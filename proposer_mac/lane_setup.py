"""What the proposer takes from the cluster file for its sessions and its draft: each
session's draft width, tree policy and capture layers from the lane, the draft's KV per
session, whether lookahead hints go out, and the target's identity and context window from
its files when they are on this machine."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cluster_config import ClusterConfig
from cluster_config.schema import Lane
from muser.errors import RefusedError
from muser.records import Identity
from muser.tree_width import TreePolicy, tree_policy
from muser.width import FixedWidth, WidthPolicy, width_policy


def lookahead_on(setting: str, verifier_address: str) -> bool:
    """lane.lookahead: "on", "off", or "auto", which is on unless the verifier's address is
    a loopback one (a verifier on this machine: its early forward would compete with the
    draft for the same cores)."""
    if setting != "auto":
        return setting == "on"
    host = verifier_address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not this machine's loopback
        return True


def draft_kv(draft, batch: bool):
    """The backend one session drafts on: a sequence of `draft` when sessions draft together
    (`batch`), else a fork when `draft` has one, else `draft` itself (a shared KV)."""
    if batch:
        return draft.sequence()
    return draft.fork() if hasattr(draft, "fork") else draft


AUTO_BRANCHES = 2
"""lane.speculate_branches "auto" for a draft that reads no capture rows (measured best of
0-4 with the independent torch draft: docs/benchmarks.md)."""


def speculate_branches(lane: Lane, draft) -> int:
    """lane.speculate_branches, "auto" resolved: 0 for a draft that reads the target's
    capture rows (the conditioned draft: its branches measured slower than none on both
    pairs, docs/conditioned.md), else `AUTO_BRANCHES`."""
    if lane.speculate_branches != "auto":
        return lane.speculate_branches
    return 0 if getattr(draft, "capture_layers", ()) else AUTO_BRANCHES


def session_capture_layers(lane: Lane, draft) -> tuple[int, ...]:
    """The layers a session captures: a conditioned draft reads the ones its checkpoint
    declares (lane.capture_layers, when set, must name the same)."""
    own = tuple(getattr(draft, "capture_layers", ()))
    if own and lane.capture_layers and tuple(lane.capture_layers) != own:
        raise RefusedError(
            f"lane.capture_layers {list(lane.capture_layers)} received; the conditioned draft "
            f"reads layers {list(own)}: drop lane.capture_layers or set it to those"
        )
    return own or tuple(lane.capture_layers)


def session_tree(lane: Lane, draft_len: int) -> TreePolicy | None:
    """A session's tree policy (`muser.tree_width`): trees of lane.tree_nodes nodes, as deep
    as the D it asked for (or lane.draft_len), in the budget's shape (lane.width "fixed") or
    learning its size and shape (lane.width "adaptive"); None (chains) without a budget or without
    a depth. A capturing session's trees need a verifier that offers `capture-trees`."""
    depth = draft_len or lane.draft_len
    if not lane.tree_nodes or depth < 1:
        return None
    return tree_policy(lane.width, lane.tree_nodes, min(depth, lane.tree_nodes), lane.decode_len)


def session_width(lane: Lane, draft_len: int) -> WidthPolicy:
    """A session's width policy: fixed at the D it asked for, or (0: it asked for none) the
    lane's — `lane.width` within [draft_len_min, draft_len_max], starting at draft_len.
    Draftless rounds decode `lane.decode_len` tokens (a capturing session's too: each step
    captures its position; on a verifier that does not offer `capture-decode`, one)."""
    if draft_len:
        return FixedWidth(draft_len, lane.decode_len)
    return width_policy(
        lane.width, lane.draft_len, lane.draft_len_min, lane.draft_len_max, lane.decode_len
    )


def identity_of(i) -> Identity:
    """A backend's model identity as the records carry it."""
    return Identity(i.model_digest, i.tokenizer_digest, i.vocab_size)


def context_length_from_files(config: ClusterConfig) -> int | None:
    """The target's context window from its files, when they are on this machine."""
    from muser.errors import MuserError
    from muser.geometry import read_geometry

    try:
        return read_geometry(config.verifier.target).context_length
    except (MuserError, OSError, ValueError):
        return None


def target_identity_from_files(config: ClusterConfig) -> Identity | None:
    """The target's identity from its files, when they are on this machine (else None)."""
    from muser.identity import model_identity

    if not (Path(config.verifier.target) / "config.json").is_file():
        return None
    return identity_of(model_identity(config.verifier.target))
