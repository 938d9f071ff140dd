"""The records both sides agree on bit for bit: session open, round request, round result.

Plain dataclasses with canonical encodings (muser.canonical); protobuf types never appear
here. Heads chain the committed rounds:

    genesis = SHA-256(canonical SessionOpen)                 (binds models, params, prompt)
    head_{r+1} = SHA-256(head_r ‖ canonical round record)    (record = result minus head/key)

The verifier signs the canonical RoundResult (domain "round-result", head and key id
included); the proposer signs the canonical RoundRequest. A request's digest is SHA-256 of
its canonical bytes, and the result binds it, so a result answers exactly one request.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from muser.canonical import CanonicalError, Reader, Writer, domain_of
from muser.logprobs import TokenLogprobs
from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, SparseRow
from muser.tree import Tree, check_path, tree_draws

TRANSCRIPT_CHUNK = 256
"""Tokens per transcript fragment: old chunks never change, so only the tail travels."""


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def state_digest(state: Mt19937) -> bytes:
    return sha256(state.to_bytes())


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def tokens_from_bytes(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<u4").tolist()


def transcript_chunks(tokens: Sequence[int]) -> list[bytes]:
    return [
        tokens_bytes(tokens[i : i + TRANSCRIPT_CHUNK])
        for i in range(0, len(tokens), TRANSCRIPT_CHUNK)
    ]


def transcript_digest(tokens: Sequence[int]) -> bytes:
    return sha256(Writer("transcript").u32s(tokens).bytes())


def draws_for_round(depth: int, accepted: int, greedy: bool, emitted: int = 1) -> int:
    """uniform_f64 draws one round consumes (docs/design.md §2): D drafting draws, one judging draw
    per attempted draft, one for the next frontier; none when greedy. A round without drafts
    (a decode round) draws once per token it emits: it is that many singleton rounds."""
    if greedy:
        return 0
    if depth == 0:
        return emitted
    return depth + min(accepted + 1, depth) + 1


def advance(state: Mt19937, draws: int) -> Mt19937:
    out = state.copy()
    for _ in range(draws):
        out.uniform_f64()
    return out


@dataclass(frozen=True)
class Identity:
    model_digest: str
    tokenizer_digest: str
    vocab_size: int


def _params(w: Writer, p: SamplingParams) -> None:
    w.f64(p.temperature).u32(p.top_k).f64(p.top_p).u32(p.max_tokens).u32s(p.stop_tokens)
    w.u32(p.seed)


def _read_params(r: Reader) -> SamplingParams:
    return SamplingParams(
        temperature=r.f64(),
        top_k=r.u32(),
        top_p=r.f64(),
        max_tokens=r.u32(),
        stop_tokens=tuple(r.u32s()),
        seed=r.u32(),
    )


def _identity(w: Writer, i: Identity) -> None:
    w.text(i.model_digest).text(i.tokenizer_digest).u32(i.vocab_size)


def _read_identity(r: Reader) -> Identity:
    return Identity(r.text(), r.text(), r.u32())


@dataclass(frozen=True)
class SessionOpen:
    session_id: bytes
    target: Identity
    draft: Identity
    params: SamplingParams
    prompt_digest: bytes
    proposer_key_id: str
    capture_layers: tuple[int, ...] = ()

    def encode(self) -> bytes:
        logprobs = self.params.logprobs
        w = Writer("session-open" if logprobs is None else LOGPROBS_OPEN).raw(self.session_id, 16)
        _identity(w, self.target)
        _identity(w, self.draft)
        _params(w, self.params)
        w.raw(self.prompt_digest, 32).text(self.proposer_key_id).u32s(self.capture_layers)
        if logprobs is not None:
            w.u32(logprobs)
        return w.bytes()

    @classmethod
    def decode(cls, data: bytes) -> SessionOpen:
        logprobs = domain_of(data) == LOGPROBS_OPEN
        r = Reader(data, LOGPROBS_OPEN if logprobs else "session-open")
        out = cls(
            r.raw(16),
            _read_identity(r),
            _read_identity(r),
            _read_params(r),
            r.raw(32),
            r.text(),
            tuple(r.u32s()),
        )
        if logprobs:
            out = replace(out, params=replace(out.params, logprobs=r.u32()))
        r.end()
        return out

    def genesis_head(self) -> bytes:
        return sha256(self.encode())

    def signed_message(self, epoch: int, resume: bytes = b"") -> bytes:
        """What the proposer signs to open (or re-open) the session at `epoch`: the epoch is
        covered, so a captured open cannot be replayed to fence the session higher. With
        `resume` (the Signed(RoundResult) bytes of the round it resumes after) its digest is
        covered too, so a captured resume cannot be replayed to move the session elsewhere."""
        if not resume:
            return Writer("session-open-at-epoch").blob(self.encode()).u64(epoch).bytes()
        w = Writer("session-resume-at-epoch").blob(self.encode()).u64(epoch)
        return w.raw(sha256(resume), 32).bytes()


def close_message(session_id: bytes, epoch: int) -> bytes:
    """What a proposer signs to close a session on the verifier."""
    return Writer("session-close").raw(session_id, 16).u64(epoch).bytes()


@dataclass(frozen=True)
class RoundRequest:
    session_id: bytes
    round: int
    epoch: int
    expected_head: bytes
    frontier: int
    drafts: tuple[int, ...]
    q_rows: tuple[SparseRow, ...]
    pre_state_digest: bytes
    transcript_digests: tuple[bytes, ...]
    proposer_key_id: str
    decode_len: int = 1
    """Tokens a round without drafts asks the verifier to sample itself, one target step and
    one draw each, stopping early at a stop token: `decode_len` singleton rounds in one
    (verifier-side decode). 1 for every round with drafts."""
    parents: tuple[int, ...] = ()
    """A tree round (docs/design.md §3, muser.tree): each draft node's parent (-1: the root,
    the frontier), and `q_rows` holds one row per position with children, in position
    order. Empty for a chain. A tree request is its own domain ("tree-round-request"), so
    a peer that knows only chains refuses its bytes and never reads it as one."""
    lookup: tuple[int, ...] = ()
    """A decode round that also ends where prompt lookup (`muser.lookup`) would propose:
    (min_n, max_n), and the verifier stops after the first token whose sequence's suffix
    occurred before, so the proposer's n-gram draft drafts the next round (its own domain,
    "lookup-round-request": a verifier that does not know it refuses it). Empty: the round
    decodes `decode_len` tokens, ending early only at a stop token."""

    @property
    def is_tree(self) -> bool:
        return bool(self.parents)

    @functools.cached_property
    def tree(self) -> Tree:
        """The tree a tree round carries (RowCountError when its rows do not fit), built once
        per request: admission, the forward, the judge and the result all read it."""
        return Tree.from_wire(self.parents, self.drafts, self.q_rows)

    def encode(self) -> bytes:
        if self.lookup and (self.parents or len(self.lookup) != 2):
            raise CanonicalError(
                f"a lookup round names (min_n, max_n) and no tree; got lookup "
                f"{list(self.lookup)} with {len(self.parents)} tree nodes"
            )
        domain = (
            TREE_REQUEST if self.parents else LOOKUP_REQUEST if self.lookup else "round-request"
        )
        w = Writer(domain).raw(self.session_id, 16)
        w.u64(self.round).u64(self.epoch).raw(self.expected_head, 32).u32(self.frontier)
        w.u32s(self.drafts)
        if self.parents:
            w.u32s(_shifted(self.parents, 1))
        w.u32(len(self.q_rows))
        for row in self.q_rows:
            w.u32s(np.asarray(row.ids)).f64s(np.asarray(row.weights))
        w.raw(self.pre_state_digest, 32).blobs(self.transcript_digests).text(self.proposer_key_id)
        w.u32(self.decode_len)
        for n in self.lookup:
            w.u32(n)
        return w.bytes()

    @classmethod
    def decode(cls, data: bytes) -> RoundRequest:
        domain = domain_of(data)
        tree, lookup = domain == TREE_REQUEST, domain == LOOKUP_REQUEST
        r = Reader(data, domain if tree or lookup else "round-request")
        head = (r.raw(16), r.u64(), r.u64(), r.raw(32), r.u32(), tuple(r.u32s()))
        parents = _tree_parents(r) if tree else ()
        rows = tuple(SparseRow(r.u32_array(), r.f64_array()) for _ in range(r.u32()))
        body = (rows, r.raw(32), tuple(r.blobs()), r.text(), r.u32(), parents)
        out = cls(*head, *body, (r.u32(), r.u32()) if lookup else ())
        r.end()
        return out

    def digest(self) -> bytes:
        return sha256(self.encode())


TREE_REQUEST, TREE_RESULT, TREE_RECORD = (
    "tree-round-request",
    "tree-round-result",
    "tree-round-record",
)
"""The domains of a tree round's records: a chain's keep theirs, byte for byte."""

LOGPROBS_OPEN = "logprobs-session-open"
"""The domain of a session's open that asks for logprobs (`SamplingParams.logprobs`): the
count of alternatives follows the open's fields. A session without keeps "session-open"."""
LOGPROBS = "logprobs-"
"""Prefixes the domain of a signed round result that carries logprobs (`RoundResult.logprobs`,
after its head and signer: the head chain does not cover them, so a proposer still computes
the head from an early decision; the verifier's signature does)."""

LOOKUP_REQUEST = "lookup-round-request"
"""The domain of a decode round's request that ends where prompt lookup proposes
(`RoundRequest.lookup`); its result is a decode round's, in the chain's domain."""


def _shifted(values: Sequence[int], by: int) -> list[int]:
    return [int(v) + by for v in values]


def _tree_parents(r: Reader) -> tuple[int, ...]:
    """A tree record's parents (written shifted by one: the root's -1 as 0); a tree record
    with no node is not canonical (its chain has its own domain)."""
    parents = tuple(_shifted(r.u32s(), -1))
    if not parents:
        raise CanonicalError("a tree round record names no node; a chain has its own domain")
    return parents


@dataclass(frozen=True)
class RoundResult:
    session_id: bytes
    round: int
    epoch: int
    prev_head: bytes
    request_digest: bytes
    frontier: int
    drafts: tuple[int, ...]
    accepted: int
    next_frontier: int
    post_state_digest: bytes
    transcript_digest: bytes
    capture_digests: tuple[bytes, ...]
    head: bytes
    verifier_key_id: str
    decoded: tuple[int, ...] = ()
    """A decode round's tokens before its next frontier (empty for a round with drafts)."""
    parents: tuple[int, ...] = ()
    """A tree round's topology, as its request carried it (empty for a chain)."""
    path: tuple[int, ...] = ()
    """A tree round's accepted nodes, root's child first (`accepted` is their count)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """With a session that asked for them, one per emitted token (muser.logprobs), in the
    signed result only (not the round record)."""

    @property
    def is_tree(self) -> bool:
        return bool(self.parents)

    def _body(self, w: Writer) -> Writer:
        if self.path and not self.parents:
            raise CanonicalError(f"a chain round result has no path, got {list(self.path)}")
        w.raw(self.session_id, 16).u64(self.round).u64(self.epoch).raw(self.prev_head, 32)
        w.raw(self.request_digest, 32).u32(self.frontier).u32s(self.drafts)
        if self.parents:
            w.u32s(_shifted(self.parents, 1)).u32s(self.path)
        w.u32(self.accepted)
        w.u32s(self.decoded).u32(self.next_frontier).raw(self.post_state_digest, 32)
        w.raw(self.transcript_digest, 32).blobs(self.capture_digests)
        return w

    def record_bytes(self) -> bytes:
        """The round record the head chains over (no head, no signer)."""
        return self._body(Writer(TREE_RECORD if self.parents else "round-record")).bytes()

    def expected_head(self) -> bytes:
        return sha256(self.prev_head + self.record_bytes())

    def encode(self) -> bytes:
        """What the verifier signs."""
        domain = TREE_RESULT if self.parents else "round-result"
        if self.logprobs and len(self.logprobs) != len(self.emitted()):
            raise CanonicalError(
                f"a result emitting {len(self.emitted())} tokens carries {len(self.logprobs)} "
                "logprobs"
            )
        w = self._body(Writer(LOGPROBS + domain if self.logprobs else domain))
        w.raw(self.head, 32).text(self.verifier_key_id)
        for lp in self.logprobs:
            w.f64(lp.logprob).u32s(lp.top_ids).f64s(lp.top_logprobs)
        return w.bytes()

    @classmethod
    def decode(cls, data: bytes) -> RoundResult:
        domain = domain_of(data) or ""
        logprobs = domain.startswith(LOGPROBS)
        domain = domain.removeprefix(LOGPROBS)
        tree = domain == TREE_RESULT
        r = Reader(data, (LOGPROBS if logprobs else "") + (TREE_RESULT if tree else "round-result"))
        head = (r.raw(16), r.u64(), r.u64(), r.raw(32), r.raw(32), r.u32(), tuple(r.u32s()))
        parents, path = (_tree_parents(r), tuple(r.u32s())) if tree else ((), ())
        accepted, decoded = r.u32(), tuple(r.u32s())
        if tree and accepted != len(path):
            raise CanonicalError(
                f"a tree round result accepts {accepted} nodes along a path of {len(path)}"
            )
        out = cls(
            *head,
            accepted,
            r.u32(),
            r.raw(32),
            r.raw(32),
            tuple(r.blobs()),
            r.raw(32),
            r.text(),
            decoded,
            parents,
            path,
        )
        if logprobs:
            out = replace(out, logprobs=tuple(_read_logprobs(r) for _ in out.emitted()))
        r.end()
        return out

    def emitted(self) -> list[int]:
        """The tokens the round emits: its accepted drafts (a tree's along its path), any
        decoded tokens, then the next frontier."""
        if self.parents:
            return [*(self.drafts[i] for i in self.path), *self.decoded, self.next_frontier]
        return [*self.drafts[: self.accepted], *self.decoded, self.next_frontier]

    def draws(self, greedy: bool) -> int:
        """The uniform_f64 draws this round consumed (docs/design.md §2, §3); a tree round's
        path must be one of its topology (`muser.tree.check_path`, TreeTopologyError)."""
        if self.parents:
            check_path(self.parents, self.path)
            return tree_draws(self.parents, self.path, greedy)
        return draws_for_round(len(self.drafts), self.accepted, greedy, len(self.emitted()))


def _read_logprobs(r: Reader) -> TokenLogprobs:
    logprob, ids, values = r.f64(), tuple(r.u32s()), tuple(r.f64s())
    if len(ids) != len(values):
        raise CanonicalError(f"logprobs name {len(ids)} tokens and {len(values)} values")
    return TokenLogprobs(logprob, ids, values)


@dataclass(frozen=True)
class Signed:
    """Canonical bytes and an Ed25519 signature over exactly those bytes."""

    body: bytes
    signature: bytes
    record: RoundRequest | RoundResult | None = field(default=None, compare=False, repr=False)
    """The record `body` is the encoding of, kept when this process made `body` by encoding
    it (never set from received bytes): the round's readers take it instead of decoding what
    was just encoded. `request_of` / `result_of` fall back to decoding `body`."""

    def encode(self) -> bytes:
        return Writer("signed").blob(self.body).blob(self.signature).bytes()

    @classmethod
    def decode(cls, data: bytes) -> Signed:
        r = Reader(data, "signed")
        out = cls(r.blob(), r.blob())
        r.end()
        return out

    @classmethod
    def of(cls, record: RoundRequest | RoundResult, signature_of) -> Signed:
        """`record` encoded, signed by `signature_of(body)`, and kept beside its bytes."""
        body = record.encode()
        return cls(body, signature_of(body), record)


def request_of(signed: Signed) -> RoundRequest:
    """The round request `signed.body` encodes."""
    record = signed.record
    return record if isinstance(record, RoundRequest) else RoundRequest.decode(signed.body)


def result_of(signed: Signed) -> RoundResult:
    """The round result `signed.body` encodes."""
    record = signed.record
    return record if isinstance(record, RoundResult) else RoundResult.decode(signed.body)
