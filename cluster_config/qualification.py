"""Qualification receipts (docs/design.md §8): the signed evidence that a lane reproduced the
non-speculative oracle on its exact models, and the check that refuses a lane without one.

`muser qualify --config FILE` runs the lane against plain target decode (muser_app.cli.qualify)
and writes the receipt; `muser config check` and the verifier daemon call `require_receipt`
before anything is served. This module loads no model: a binding holds digests of the
checkpoint files (muser.identity, cached on disk), so a changed weight or config file voids
the receipt.

The receipt file (`lane.receipt`, default `qualification.json` beside the cluster file) is
JSON, a carrier only:

    {"format": "muser.qualification-receipt.v3",
     "software": {"package": "muser-cluster", "version": "0.1.0"},
     "target": {"model_digest", "tokenizer_digest", "vocab_size", "architecture",
                "backend", "dtype", "device", "forward"},
     "draft":  {... the same eight fields, from the proposer's draft},
     "lane":   {every [lane] knob but receipt and acceptance_floor: draft_len,
                draft_len_min, draft_len_max, q_top_k, capture_layers (the layers the
                sessions ask for: a conditioned draft's own when the knob is empty), ...},
     "evidence": {"prompts", "prompts_digest", "tokens_per_prompt", "tolerance",
                  "rows_compared", "worst_logprob_diff", "drafted", "accepted",
                  "acceptance"},
     "qualified_at": unix seconds,
     "verifier_key": key id of the signer,
     "signature": hex Ed25519 signature}

The signature covers `signed_bytes`: the canonical encoding (muser.canonical) under domain
"qualification-receipt", with the fields above in that order (lane knobs sorted by name,
each value type-tagged); "acceptance" is derived and not signed. Editing any signed field
breaks the signature. A receipt exists only for a run whose every greedy token matched the
oracle, so it records how closely the rows matched, not whether the tokens did.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cluster_config.schema import ClusterConfig, ConfigError, Lane
from muser.canonical import CanonicalError, Writer
from muser.errors import MuserError

FORMAT = "muser.qualification-receipt.v3"
"""v3 binds the torch target's forward, v2 each side's device kind; an earlier receipt (which
did not) is refused: re-qualify."""
EARLIER_FORMATS = {
    "muser.qualification-receipt.v1": "did not bind the device",
    "muser.qualification-receipt.v2": "did not bind the target's forward",
}
DOMAIN = "qualification-receipt"
PACKAGE = "muser-cluster"
MIN_TOKENS = 256
"""Greedy tokens per prompt a qualification must compare (docs/design.md §8)."""
DEFAULT_TOLERANCE = 1e-4
"""Largest |log p_lane - log p_oracle| allowed over every entry of every target row. The
target computes in float32 and a (D+1)-token forward sums in another order than a 1-token
forward: over 24 fixture prompts x 256 tokens the worst entry measured 1.1e-5 (see
tests/lanes/test_local_lane.py), so 1e-4 leaves ~9x headroom while a lane whose rows come
from the wrong position or cache differs by orders of magnitude more. Reduced-precision
targets (bfloat16, float16) need a wider `--tolerance`, which the receipt records."""
UNBOUND_LANE_KNOBS = frozenset(
    {
        "receipt",
        "acceptance_floor",
        "speculate",
        "speculate_branches",
        "lookahead",
        "send_on_decision",
    }
)
"""Lane fields that are not lane params: where the receipt lives, the floor (checked
against the recorded acceptance instead, so raising it above the evidence voids the receipt),
and speculation, which only decides when a draft is computed, never what it is
(tests/proposer/test_speculation.py holds speculative drafts bit-equal to plain ones).
Greedy branches draft in batched forwards on clones, whose rows may differ from a lone
forward's in the last bits, as `draft_batch` does: that can move a draft, never a greedy
token (each is the target's own pick). `send_on_decision` only decides when a request goes
out, never what it says."""


class QualificationError(ConfigError):
    """No receipt, or one that does not qualify this cluster's lane: refused (exit 2)."""


class QualificationFailed(MuserError):
    """The lane did not reproduce the oracle, or its acceptance is under the floor (exit 1)."""

    exit_code = 1


@dataclass(frozen=True)
class ModelBinding:
    """One side's model, bit for bit, and how it is run."""

    model_digest: str
    tokenizer_digest: str
    vocab_size: int
    architecture: str
    backend: str
    dtype: str
    device: str
    """Where it ran, by kind: `cpu`, `cuda` (any `cuda:N`), the mlx draft's `auto`/`gpu`. A
    receipt made on one kind of device does not admit another: the rows a lane was checked
    against were computed there (issue 34)."""
    forward: str
    """The torch target's `verifier.forward` (auto, packed, lean, transformers): the packed
    forward's rows are the lean one's within rounding, not bit for bit, so the rows a lane
    was checked against came from this one. Empty for a vLLM target and for the draft."""


@dataclass(frozen=True)
class Binding:
    """Everything a receipt is bound to; any difference voids it."""

    version: str
    target: ModelBinding
    draft: ModelBinding
    lane: dict
    """Lane params by name (JSON values), every knob of [lane] but UNBOUND_LANE_KNOBS."""

    def key(self) -> bytes:
        """Canonical bytes of the binding: equal bindings, equal keys."""
        w = Writer("qualification-binding")
        _binding(w, self)
        return w.bytes()


@dataclass(frozen=True)
class Evidence:
    """What the qualification run measured (muser_app.cli.qualify)."""

    prompts: int
    prompts_digest: str
    """SHA-256 (hex) of `prompts_digest(token lists)`: which prompts were decoded."""
    tokens_per_prompt: int
    tolerance: float
    rows_compared: int
    worst_logprob_diff: float
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        """accepted / drafted; 0 for a lane that drafted nothing (D = 0)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True)
class Receipt:
    binding: Binding
    evidence: Evidence
    qualified_at: int
    verifier_key: str
    signature: bytes


def software_version() -> str:
    """The installed package version the receipt binds (a new release re-qualifies)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        from muser import __version__

        return __version__


def lane_params(lane: Lane) -> dict:
    return lane.model_dump(mode="json", exclude=set(UNBOUND_LANE_KNOBS))


def binding_of(config: ClusterConfig, receipt: Receipt | None = None) -> Binding:
    """The binding a receipt for `config` must carry: digests of the checkpoint files now.

    On a verifier that does not hold the draft's files (the draft lives on the proposer's
    machine), pass the receipt: its draft binding stands in for the files, and the verifier
    refuses at session open any draft whose digests differ from it (`qualified_draft`)."""
    from muser.errors import ModelLoadError
    from muser.identity import draft_identity, model_identity

    sides = {}
    for role, node, field in (
        ("verifier", config.verifier, "target"),
        ("proposer", config.proposer, "draft"),
    ):
        if field == "draft" and receipt is not None and not draft_files_here(config):
            held = receipt.binding.draft
            sides[field] = replace(
                held,
                backend=node.backend,
                dtype=node.dtype,
                device=device_kind(node.device),
                forward="",
            )
            continue
        try:
            path = getattr(node, field)
            ident = draft_identity(node.backend, path) if field == "draft" else model_identity(path)
        except ModelLoadError as exc:
            raise QualificationError(
                f"cannot digest {role}.{field} ({exc}): the receipt binds both checkpoints, so "
                f"their files must be at {role}.{field} here too (hashed, never loaded)"
            ) from exc
        sides[field] = ModelBinding(
            ident.model_digest,
            ident.tokenizer_digest,
            ident.vocab_size,
            ident.architecture,
            node.backend,
            node.dtype,
            device_kind(node.device),
            node.forward if field == "target" and node.backend == "torch" else "",
        )
    lane = lane_params(config.lane)
    lane["capture_layers"] = session_capture_layers(config, receipt)
    return Binding(software_version(), sides["target"], sides["draft"], lane)


def session_capture_layers(config: ClusterConfig, receipt: Receipt | None = None) -> list[int]:
    """The target layers whose rows the lane's sessions ask for, as the receipt binds them:
    lane.capture_layers, or a conditioned draft's own (declared in its checkpoint, which
    lane.capture_layers, when set, must equal: `proposer_mac.lane_setup`); on a verifier
    without the draft's files, the receipt's (its draft binding stands in likewise)."""
    from muser.errors import ModelLoadError
    from muser.identity import declared_capture_layers

    if config.lane.capture_layers or config.proposer.backend != "conditioned":
        return list(config.lane.capture_layers)
    if receipt is not None and not draft_files_here(config):
        return list(receipt.binding.lane.get("capture_layers", []))
    try:
        return list(declared_capture_layers(config.proposer.draft))
    except ModelLoadError as exc:
        raise QualificationError(
            f"cannot read the capture layers proposer.draft declares ({exc}): the receipt "
            "binds them, so its files must be at proposer.draft here too"
        ) from exc


def device_kind(device: str) -> str:
    """`cuda:1` -> `cuda`: a receipt binds the kind of device, not which one of a kind."""
    return device.partition(":")[0]


def draft_files_here(config: ClusterConfig) -> bool:
    """Whether the draft checkpoint is on this machine (single-host clusters, `qualify`)."""
    return (Path(config.proposer.draft) / "config.json").is_file()


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    w = Writer("qualification-prompts").u32(len(prompts))
    for tokens in prompts:
        w.u32s(tokens)
    return hashlib.sha256(w.bytes()).hexdigest()


# --- canonical bytes --------------------------------------------------------------------------


def _value(w: Writer, v: object) -> None:
    """A lane knob's JSON value, type-tagged so no two values share bytes."""
    if v is None:
        w.u32(0)
    elif isinstance(v, bool):
        w.u32(1).u32(int(v))
    elif isinstance(v, int):
        w.u32(2).text(str(v))
    elif isinstance(v, float):
        w.u32(3).f64(v)
    elif isinstance(v, str):
        w.u32(4).text(v)
    elif isinstance(v, list | tuple):
        w.u32(5).u32(len(v))
        for item in v:
            _value(w, item)
    elif isinstance(v, dict):
        w.u32(6).u32(len(v))
        for k in sorted(v):
            w.text(str(k))
            _value(w, v[k])
    else:
        raise TypeError(f"lane value {v!r} has no canonical encoding")


def _model(w: Writer, m: ModelBinding) -> None:
    w.raw(bytes.fromhex(m.model_digest), 32).raw(bytes.fromhex(m.tokenizer_digest), 32)
    w.u32(m.vocab_size).text(m.architecture).text(m.backend).text(m.dtype).text(m.device)
    w.text(m.forward)


def _binding(w: Writer, b: Binding) -> None:
    w.text(PACKAGE).text(b.version)
    _model(w, b.target)
    _model(w, b.draft)
    _value(w, dict(b.lane))


def signed_bytes(binding: Binding, evidence: Evidence, qualified_at: int, key: str) -> bytes:
    w = Writer(DOMAIN)
    _binding(w, binding)
    e = evidence
    w.u32(e.prompts).raw(bytes.fromhex(e.prompts_digest), 32).u32(e.tokens_per_prompt)
    w.f64(e.tolerance).u64(e.rows_compared).f64(e.worst_logprob_diff)
    w.u64(e.drafted).u64(e.accepted)
    w.u64(qualified_at).text(key)
    return w.bytes()


def sign(
    binding: Binding,
    evidence: Evidence,
    private: Ed25519PrivateKey,
    *,
    qualified_at: int | None = None,
) -> Receipt:
    """Sign `evidence` for `binding` with the verifier's key (the one that will serve it)."""
    from muser import keys

    at = int(time.time()) if qualified_at is None else qualified_at
    key = keys.key_id(private.public_key())
    signature = private.sign(signed_bytes(binding, evidence, at, key))
    return Receipt(binding, evidence, at, key, signature)


def verify_signature(receipt: Receipt, public: Ed25519PublicKey) -> None:
    """SignatureError unless `public` signed exactly this receipt."""
    from muser import keys

    message = signed_bytes(
        receipt.binding, receipt.evidence, receipt.qualified_at, receipt.verifier_key
    )
    keys.verify(public, message, receipt.signature, "qualification receipt")


# --- the file ---------------------------------------------------------------------------------


def to_json(receipt: Receipt) -> dict:
    b = receipt.binding
    return {
        "format": FORMAT,
        "software": {"package": PACKAGE, "version": b.version},
        "target": asdict(b.target),
        "draft": asdict(b.draft),
        "lane": dict(b.lane),
        "evidence": {**asdict(receipt.evidence), "acceptance": receipt.evidence.acceptance},
        "qualified_at": receipt.qualified_at,
        "verifier_key": receipt.verifier_key,
        "signature": receipt.signature.hex(),
    }


def from_json(data: object) -> Receipt:
    """Parse the carrier; ValueError/KeyError/TypeError on a malformed one (see read_receipt)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        earlier = EARLIER_FORMATS.get(got) if isinstance(got, str) else None
        raise ValueError(
            f"format is {got!r}, expected {FORMAT!r}"
            + (f" (an earlier format that {earlier}: re-qualify)" if earlier else "")
        )
    software = data["software"]
    if software["package"] != PACKAGE:
        raise ValueError(f"package is {software['package']!r}, expected {PACKAGE!r}")
    evidence = {k: v for k, v in data["evidence"].items() if k != "acceptance"}
    binding = Binding(
        str(software["version"]),
        ModelBinding(**data["target"]),
        ModelBinding(**data["draft"]),
        dict(data["lane"]),
    )
    receipt = Receipt(
        binding,
        Evidence(**evidence),
        int(data["qualified_at"]),
        str(data["verifier_key"]),
        bytes.fromhex(data["signature"]),
    )
    # values of the wrong type or size fail here, as a malformed file, not at verification
    signed_bytes(binding, receipt.evidence, receipt.qualified_at, receipt.verifier_key)
    return receipt


def write_receipt(path: Path, receipt: Receipt) -> None:
    """Write atomically (temp file, fsync, rename): a reader sees the old or the new receipt."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(to_json(receipt), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_receipt(path: Path) -> Receipt:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise QualificationError(f"no qualification receipt at {path}") from None
    except OSError as exc:
        raise QualificationError(f"cannot read the qualification receipt {path}: {exc}") from exc
    try:
        return from_json(json.loads(text))
    except (ValueError, KeyError, TypeError, struct.error, CanonicalError) as exc:
        raise QualificationError(
            f"{path} is not a valid qualification receipt ({type(exc).__name__}: {exc})"
        ) from exc


# --- matching -------------------------------------------------------------------------------


def binding_differences(receipt: Binding, now: Binding) -> list[str]:
    """What differs between the binding a receipt carries and the cluster's, field by field."""
    out = []
    if receipt.version != now.version:
        out.append(f"software version: qualified {receipt.version}, installed {now.version}")
    for side, role in (("target", "verifier.target"), ("draft", "proposer.draft")):
        old, new = asdict(getattr(receipt, side)), asdict(getattr(now, side))
        for name in old:
            if old[name] != new[name]:
                what = f"{side} {name}"
                if name in ("model_digest", "tokenizer_digest"):
                    what += f" (a file under {role} changed since qualification)"
                out.append(f"{what}: qualified {old[name]!r}, now {new[name]!r}")
    for name in sorted(set(receipt.lane) | set(now.lane)):
        old, new = receipt.lane.get(name), now.lane.get(name)
        if old != new:
            out.append(f"lane.{name}: qualified {old!r}, now {new!r}")
    return out


def evidence_problems(evidence: Evidence, floor: float) -> list[str]:
    """Why recorded evidence does not qualify a lane under `floor` (empty: it does)."""
    e, out = evidence, []
    if e.prompts < 1:
        out.append("no prompts were decoded")
    if e.tokens_per_prompt < MIN_TOKENS:
        out.append(f"{e.tokens_per_prompt} tokens per prompt, at least {MIN_TOKENS} are required")
    if not math.isfinite(e.worst_logprob_diff) or not e.worst_logprob_diff <= e.tolerance:
        out.append(
            f"a target row differs from plain decode by {e.worst_logprob_diff:.3g} in log-prob, "
            f"over the tolerance {e.tolerance:.3g}"
        )
    if not e.acceptance >= floor:
        out.append(
            f"acceptance {e.acceptance:.3f} ({e.accepted}/{e.drafted}) is under "
            f"lane.acceptance_floor {floor}"
        )
    return out


def qualify_hint(config: ClusterConfig) -> str:
    return f"run `muser qualify --config {config.path or 'FILE'}`"


def require_receipt(config: ClusterConfig) -> Receipt:
    """The receipt that qualifies `config`'s lane, or QualificationError saying why not.

    Checks, in order: the file exists and parses; it is signed by this verifier's key and the
    signature verifies; the binding (software version, both models' digests and runtime, lane
    params) equals the cluster's now; the evidence meets the policy and lane.acceptance_floor.
    """
    from muser import keys

    path = config.lane.receipt
    hint = qualify_hint(config)
    try:
        receipt = read_receipt(path)
    except QualificationError as exc:
        raise QualificationError(f"the lane is not qualified: {exc}; {hint}") from exc
    public = keys.load_public(config.verifier.public_key)
    ours = keys.key_id(public)
    if receipt.verifier_key != ours:
        raise QualificationError(
            f"the qualification receipt {path} is signed by key {receipt.verifier_key}, not by "
            f"this verifier's key {ours} ({config.verifier.public_key}); {hint}"
        )
    try:
        verify_signature(receipt, public)
    except keys.SignatureError as exc:
        raise QualificationError(
            f"the qualification receipt {path} was altered after signing ({exc}); {hint}"
        ) from exc
    problems = binding_differences(receipt.binding, binding_of(config, receipt))
    if problems:
        raise QualificationError(
            f"the qualification receipt {path} is for another lane: {'; '.join(problems)}; {hint}"
        )
    problems = evidence_problems(receipt.evidence, config.lane.acceptance_floor)
    if problems:
        raise QualificationError(
            f"the qualification receipt {path} does not qualify the lane: "
            f"{'; '.join(problems)}; {hint}"
        )
    return receipt


def pool_targets(config: ClusterConfig) -> dict[str, ModelBinding]:
    """Each verifier of the pool ([verifier] and every [[pool]]) by name: the target its
    receipt, signed by its own key, qualified. QualificationError for a missing, unreadable
    or wrongly signed receipt, naming the verifier."""
    from muser import keys

    members = [(config.verifier.name, config.verifier.public_key, config.lane.receipt)] + [
        (v.name, v.public_key, v.receipt) for v in config.pool
    ]
    out: dict[str, ModelBinding] = {}
    for name, public_path, path in members:
        receipt = read_receipt(path)
        public = keys.load_public(public_path)
        if receipt.verifier_key != keys.key_id(public):
            raise QualificationError(
                f"pool verifier {name!r}: its receipt {path} is signed by key "
                f"{receipt.verifier_key}, not by its key {keys.key_id(public)} ({public_path})"
            )
        try:
            verify_signature(receipt, public)
        except keys.SignatureError as exc:
            raise QualificationError(
                f"pool verifier {name!r}: its receipt {path} was altered after signing ({exc})"
            ) from exc
        out[name] = receipt.binding.target
    return out


def check_pool_identity(config: ClusterConfig) -> None:
    """A pool must be qualified on one target identity (model, tokenizer, vocabulary,
    architecture, backend, dtype, device kind): two target engines are distinct epochs, and
    a session moved between them would silently change its distribution. QualificationError
    naming the verifiers of each identity."""
    if not config.pool:
        return
    targets = pool_targets(config)
    groups: dict[ModelBinding, list[str]] = {}
    for name, target in targets.items():
        groups.setdefault(target, []).append(name)
    if len(groups) > 1:
        described = "; ".join(
            f"{', '.join(map(repr, names))}: model {t.model_digest[:12]}, tokenizer "
            f"{t.tokenizer_digest[:12]}, {t.architecture}, {t.backend} {t.dtype} on {t.device}"
            for t, names in groups.items()
        )
        raise QualificationError(
            f"the verifier pool mixes {len(groups)} target identities ({described}); every "
            "verifier a session may move to must run the same target the same way: remove "
            "the others from [[pool]] or re-qualify them on one target"
        )
