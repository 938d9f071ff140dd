"""Refusal rules checked by `muser config check` and again when a daemon starts (§7).

`check_rules` runs `RULES` in order; each is a small named function that raises
`ConfigError` with a message telling the operator what to change. A rule reads files (keys,
certificates, checkpoint metadata and tokenizer files) but never loads weights.

A daemon checks with its `role`: it needs its own private keys, not the other node's, which
may live on another machine. `muser config check` without `--role` checks everything.

Config imports no daemon (docs/architecture.md): what only the backends know (which target
backends capture hidden rows, whether a device exists) comes in as `BackendChecks`, from
the caller (`muser_app.checks.backend_checks` assembles both daemons' own).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cluster_config.schema import TLS_ROLES, ClusterConfig, ConfigError
from muser.errors import MuserError

Role = Literal["verifier", "proposer"]
NODES = ("verifier", "proposer")


@dataclass(frozen=True)
class BackendChecks:
    """What only the backends know, handed to the rules by the caller."""

    capture_kinds: tuple[str, ...]
    """Target backends that return hidden rows (`lane.capture_layers` needs one)."""
    target_device: Callable[[str], object]
    """Raises a `MuserError` saying what is missing when the torch target's device (the
    `verifier.device` value) is not on this machine."""
    draft_device: Callable[[str], object]
    """The same for the mlx draft's `proposer.device`; `ImportError` without mlx."""


@dataclass(frozen=True)
class Scope:
    """What a rule checks against: whose private files (`"verifier" in scope`: one node's,
    or every role's, client included) and the backends' own checks."""

    roles: frozenset[str]
    backends: BackendChecks

    def __contains__(self, role: object) -> bool:
        return role in self.roles


Rule = Callable[[ClusterConfig, Scope], None]


def _scope(role: Role | None, backends: BackendChecks) -> Scope:
    return Scope(frozenset(TLS_ROLES if role is None else (role,)), backends)


# --- addresses -----------------------------------------------------------------------------


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
"""Hosts that bind a port on every interface of the machine (`[::]` and `[]` without their
brackets): such a server takes the port from every other address of that machine."""


def _endpoint(address: str) -> str:
    from muser.tls import host_of

    host, port = host_of(address), address.rpartition(":")[2]
    return f"{'127.0.0.1' if host == 'localhost' else host}:{port}"


def _host_port(endpoint: str) -> tuple[str, str]:
    host, _, port = endpoint.rpartition(":")
    return host, port


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listeners(config: ClusterConfig) -> list[tuple[str, str, dict[str, str]]]:
    """Each server the cluster runs: (name, node, {field: HOST:PORT as written}) for the
    addresses (address and bind) it occupies."""
    out = []
    for role in NODES:
        node = getattr(config, role)
        fields = {f"{role}.address": node.address}
        if node.bind is not None:
            fields[f"{role}.bind"] = node.bind
        out.append((f"{role}.address", role, fields))
        http = getattr(node, "http", None)
        if isinstance(http, str):
            out.append((f"{role}.http", role, {f"{role}.http": http}))
    return out


def _nodes_apart(config: ClusterConfig) -> bool:
    """Whether the two nodes are known to run on two machines: their addresses name different
    hosts, neither a wildcard, and the verifier's is not a loopback one (the proposer dials
    it, so a loopback verifier address puts both on one machine)."""
    verifier = _host_port(_endpoint(config.verifier.address))[0]
    proposer = _host_port(_endpoint(config.proposer.address))[0]
    return (
        verifier != proposer
        and not {verifier, proposer} & WILDCARD_HOSTS
        and not _loopback(verifier)
    )


def _wildcard_clash(fields: dict[str, str], other_fields: dict[str, str]) -> str | None:
    """The message for two endpoints on one port of one machine, one of them a wildcard."""
    for field, address in fields.items():
        host, port = _host_port(_endpoint(address))
        for other_field, other_address in other_fields.items():
            other_host, other_port = _host_port(_endpoint(other_address))
            if port == other_port and {host, other_host} & WILDCARD_HOSTS:
                wildcard, any_host = (
                    (field, other_field) if host in WILDCARD_HOSTS else (other_field, field)
                )
                return (
                    f"{field} {address!r} and {other_field} {other_address!r} both use port "
                    f"{port} on one machine: {wildcard} binds it on every interface, so "
                    f"{any_host} cannot have it too; give each server its own HOST:PORT"
                )
    return None


def distinct_addresses(config: ClusterConfig, scope: Scope) -> None:
    """Each server its own HOST:PORT. localhost is 127.0.0.1; a wildcard host (0.0.0.0, [::])
    takes its port on every interface, so it clashes with any host on that port on the same
    machine: within a node always, across the nodes unless they are known to be apart."""
    listeners = _listeners(config)
    apart = _nodes_apart(config)
    for i, (name, node, fields) in enumerate(listeners):
        for other, other_node, other_fields in listeners[i + 1 :]:
            endpoints = {_endpoint(address) for address in fields.values()}
            if shared := sorted(endpoints & {_endpoint(a) for a in other_fields.values()}):
                raise ConfigError(
                    f"{name} and {other} both use {shared[0]!r} (addresses and binds "
                    "compared); give each server its own HOST:PORT"
                )
            one_machine = node == other_node or not apart
            if one_machine and (message := _wildcard_clash(fields, other_fields)):
                raise ConfigError(message)


# --- models --------------------------------------------------------------------------------


def _checkpoint_config(model_dir: Path, where: str) -> dict:
    from muser.identity import read_config

    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(
            f"{where} {model_dir} has no config.json: point it at a Hugging Face checkpoint "
            "directory (or run `muser fixtures build`)"
        )
    try:
        return read_config(Path(model_dir))
    except MuserError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def model_directories(config: ClusterConfig, scope: Scope) -> None:
    # Each machine needs only its own model: the proposer asks the verifier for the target's
    # identity when the files are not here (proposer_mac.daemon.ask_target_identity).
    if "verifier" in scope:
        _checkpoint_config(config.verifier.target, "verifier.target")
    if "proposer" in scope:  # the verifier's machine need not hold the draft
        _checkpoint_config(config.proposer.draft, "proposer.draft")


def _has_tokenizer(model_dir: Path, where: str) -> None:
    from muser.identity import _tokenizer_files

    if not _tokenizer_files(Path(model_dir)):
        raise ConfigError(
            f"{where} {model_dir} has no tokenizer files (tokenizer.json, vocab, merges); "
            "copy the checkpoint's tokenizer there"
        )


def shared_tokenizer(config: ClusterConfig, scope: Scope) -> None:
    """The draft's vocabulary agrees with the target's on every id and token both define
    (`muser.vocabulary`; the embedding sizes may differ)."""
    if "proposer" not in scope:  # the session-open handshake checks it again
        return
    if "verifier" not in scope and not (Path(config.verifier.target) / "config.json").is_file():
        return  # a proposer without the target's files checks the verifier's answer at start
    from muser.errors import ModelLoadError, ModelMismatchError
    from muser.identity import config_value
    from muser.vocabulary import require_compatible

    _has_tokenizer(config.verifier.target, "verifier.target")
    _has_tokenizer(config.proposer.draft, "proposer.draft")
    try:
        rows = config_value(
            _checkpoint_config(config.proposer.draft, "proposer.draft"), "vocab_size"
        )
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ModelLoadError(
                f"{config.proposer.draft}/config.json: vocab_size is {rows!r}, expected an int >= 1"
            )
        require_compatible(config.verifier.target, config.proposer.draft, rows)
    except (ModelMismatchError, ModelLoadError) as exc:
        raise ConfigError(
            f"proposer.draft {config.proposer.draft} and verifier.target "
            f"{config.verifier.target} do not share a vocabulary: {exc}"
        ) from exc


def capture_layers_exist(config: ClusterConfig, scope: Scope) -> None:
    from muser.geometry import read_geometry

    layers = config.lane.capture_layers
    if not layers:
        return
    capture_kinds = scope.backends.capture_kinds
    if config.verifier.backend not in capture_kinds:
        raise ConfigError(
            f"lane.capture_layers {layers} needs a target backend that captures hidden rows "
            f"({', '.join(capture_kinds)}), but verifier.backend is "
            f"{config.verifier.backend!r}: set capture_layers = [] or change the backend"
        )
    try:
        count = read_geometry(config.verifier.target).num_layers
    except MuserError as exc:
        raise ConfigError(f"verifier.target: {exc}") from exc
    bad = [x for x in layers if x >= count]
    if bad:
        raise ConfigError(
            f"lane.capture_layers {layers} names layer {bad[0]}, but verifier.target "
            f"{config.verifier.target} has {count} decoder layers: use indices in [0, {count})"
        )


def draft_dtype_supported(config: ClusterConfig, scope: Scope) -> None:
    p = config.proposer
    if p.backend != "torch" and p.dtype != "float32":
        runs = {
            "mlx": "runs in the dtype its checkpoint stores",
            "conditioned": "runs float32",
            "ngram": "has no weights",
        }[p.backend]
        raise ConfigError(
            f"proposer.dtype {p.dtype!r} needs proposer.backend 'torch'; the {p.backend} draft "
            f'{runs}: set dtype = "float32" or backend = "torch"'
        )


def target_forward_applies(config: ClusterConfig, scope: Scope) -> None:
    """verifier.forward chooses among the torch backend's forwards; vLLM runs its own."""
    v = config.verifier
    if v.forward != "auto" and v.backend != "torch":
        raise ConfigError(
            f"verifier.forward {v.forward!r} chooses the torch backend's forward, but "
            f'verifier.backend is {v.backend!r}: remove it or set forward = "auto"'
        )


def tree_lane(config: ClusterConfig, scope: Scope) -> None:
    """lane.tree_nodes: trees are drafted by a torch or conditioned draft (each evaluates a
    token tree on a KV of its own) or by prompt lookup (its rows are its candidates), judged
    by either target kind (torch in one forward under a tree mask, vLLM its paths in one
    engine step), a capturing session's too (both keep every node's capture rows)."""
    lane = config.lane
    if not lane.tree_nodes:
        return
    if config.proposer.backend not in ("torch", "conditioned", "ngram"):
        raise ConfigError(
            f"lane.tree_nodes {lane.tree_nodes} needs proposer.backend 'torch', 'conditioned' "
            f"or 'ngram' (a draft that drafts token trees); proposer.backend is "
            f"{config.proposer.backend!r}: set lane.tree_nodes = 0 (chains) or change the "
            "backend"
        )


def devices_available(config: ClusterConfig, scope: Scope) -> None:
    """The device each node's config names exists on this machine (nothing is loaded).

    Only a GPU asked for by name is checked: "auto" and "cpu" always resolve."""
    p, v = config.proposer, config.verifier
    if "proposer" in scope and p.device == "gpu":
        if p.backend == "torch":
            raise ConfigError(
                "proposer.device 'gpu' applies to the mlx draft; the torch draft runs on CPU: "
                'set backend = "mlx" (Metal on a Mac) or device = "cpu"'
            )
        try:
            scope.backends.draft_device(p.device)
        except ImportError as exc:
            raise ConfigError(
                f"proposer.device 'gpu' needs the mlx package ({exc}): `pip install -e .`"
            ) from exc
        except MuserError as exc:
            raise ConfigError(str(exc)) from exc
    if "verifier" in scope and v.backend == "torch" and v.device != "cpu":
        try:
            scope.backends.target_device(v.device)
        except MuserError as exc:
            raise ConfigError(str(exc)) from exc


def cpus_available(config: ClusterConfig, scope: Scope) -> None:
    """The CPUs a node's config pins its daemon to are CPUs this machine lets it run on."""
    from muser.affinity import AffinityError, check

    for role in NODES:
        cpus = getattr(config, role).cpus
        if role in scope and cpus is not None:
            try:
                check(cpus, f"{role}.cpus")
            except AffinityError as exc:
                raise ConfigError(str(exc)) from exc


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # unreadable: look at its parent
        return False


def wal_directories(config: ClusterConfig, scope: Scope) -> None:
    """A node's wal_dir is a directory, or a path its daemon can create one at: its nearest
    existing ancestor is a directory (a file there fails `serve` only once it starts)."""
    for role in NODES:
        if role not in scope:
            continue
        wal_dir = Path(getattr(config, role).wal_dir)
        existing = next((p for p in (wal_dir, *wal_dir.parents) if _exists(p)), None)
        if existing is None or existing.is_dir():
            continue
        where = "is" if existing == wal_dir else f"is under {existing}, which is"
        raise ConfigError(
            f"{role}.wal_dir {wal_dir} {where} not a directory; expected a directory (or a "
            "path where one can be created): point it at a directory of its own, e.g. "
            f'wal_dir = "wal/{role}" beside the cluster file'
        )


# --- signing keys and enrolment ------------------------------------------------------------


def _keys_match(private: Path, public: Path, role: str) -> None:
    from muser import keys

    priv = keys.load_private(private)
    pub = keys.load_public(public)
    if keys.key_id(priv.public_key()) != keys.key_id(pub):
        raise ConfigError(
            f"{role}.public_key {public} is not the public half of {role}.key {private}; "
            f"regenerate the pair with `muser keygen`"
        )


def signing_keys(config: ClusterConfig, scope: Scope) -> None:
    for role in NODES:
        if role in scope:
            node = getattr(config, role)
            _keys_match(node.key, node.public_key, role)


def enrolment(config: ClusterConfig, scope: Scope) -> None:
    from muser import keys

    for role, enrolled in (
        ("verifier", config.enrolment.verifiers),
        ("proposer", config.enrolment.proposers),
    ):
        public = getattr(config, role).public_key
        key_id = keys.key_id(keys.load_public(public))
        if key_id not in {keys.key_id(keys.load_public(p)) for p in enrolled}:
            raise ConfigError(
                f"the {role}'s key {key_id} is not in enrolment.{role}s; add {public} there"
            )


def pool_members(config: ClusterConfig, scope: Scope) -> None:
    """Every [[pool]] verifier's key is enrolled (its results, and resume points signed by
    it, are taken everywhere) and distinct; the pool is qualified on one target identity
    (`check_pool_identity`). Checked where the proposer runs: the pool is its list."""
    from muser import keys

    if not config.pool or "proposer" not in scope:
        return
    enrolled = {keys.key_id(keys.load_public(p)) for p in config.enrolment.verifiers}
    primary = keys.key_id(keys.load_public(config.verifier.public_key))
    seen: dict[str, str] = {primary: config.verifier.name}
    for member in config.pool:
        key_id = keys.key_id(keys.load_public(member.public_key))
        if key_id not in enrolled:
            raise ConfigError(
                f"pool verifier {member.name!r}: its key {key_id} ({member.public_key}) is not "
                "in enrolment.verifiers; add it there"
            )
        if key_id in seen:
            raise ConfigError(
                f"pool verifiers {seen[key_id]!r} and {member.name!r} have one key {key_id}: "
                "each verifier signs with its own key"
            )
        seen[key_id] = member.name
    from cluster_config.qualification import check_pool_identity

    check_pool_identity(config)


# --- TLS -------------------------------------------------------------------------------------


def _tls_pair(config: ClusterConfig, role: str, ca) -> None:
    """The role's certificate is signed by the CA, current, and matches its key."""
    from muser import tls

    pair = config.tls.pair(role)
    cert = tls.load_cert(pair.cert, f"tls.{role}.cert")
    key = tls.load_key(pair.key, f"tls.{role}.key")
    if not tls.signed_by(cert, ca):
        raise ConfigError(
            f"tls.{role}.cert {pair.cert} is not signed by tls.ca {config.tls.ca}: issue it "
            "from that CA (`muser keygen --out DIR --tls` writes a matching set)"
        )
    if tls.public_der(key.public_key()) != tls.public_der(cert.public_key()):
        raise ConfigError(
            f"tls.{role}.key {pair.key} is not the key of tls.{role}.cert {pair.cert}; "
            "give the key the certificate was issued for"
        )
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            f"tls.{role}.cert {pair.cert} is valid {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d}, not now: issue a new one"
        )
    node = getattr(config, role, None)
    if role in NODES and tls.host_of(node.address) not in tls.subject_names(cert):
        host = tls.host_of(node.address)
        raise ConfigError(
            f"tls.{role}.cert {pair.cert} is not valid for {host!r} ({role}.address); its "
            f"names are {sorted(tls.subject_names(cert))}: reissue it with `muser keygen "
            f"--tls --host {host}`"
        )


def tls_files(config: ClusterConfig, scope: Scope) -> None:
    from muser import tls

    if config.tls is None:
        return
    try:
        ca = tls.load_cert(config.tls.ca, "tls.ca")
        for role in TLS_ROLES:
            if role in scope:
                _tls_pair(config, role, ca)
    except tls.TlsError as exc:
        raise ConfigError(f"{exc}; fix the [tls] section or remove it") from exc


RULES: tuple[Rule, ...] = (
    distinct_addresses,
    model_directories,
    shared_tokenizer,
    capture_layers_exist,
    draft_dtype_supported,
    target_forward_applies,
    tree_lane,
    devices_available,
    cpus_available,
    wal_directories,
    signing_keys,
    enrolment,
    pool_members,
    tls_files,
)


def check_rules(
    config: ClusterConfig,
    role: Role | None = None,
    *,
    backends: BackendChecks,
    receipt: bool = True,
) -> None:
    """Refuse a configuration any rule refuses; `role` limits private files to one node.
    `receipt=False` skips the lane's qualification receipt (`muser qualify` checks the rest
    before it writes one)."""
    scope = _scope(role, backends)
    for rule in RULES:
        rule(config, scope)
    if receipt and "verifier" in scope:  # last: it digests both checkpoints (docs/design.md §8)
        from cluster_config.qualification import require_receipt

        require_receipt(config)
