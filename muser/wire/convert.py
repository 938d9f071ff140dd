"""Protobuf <-> plain records, in one place: the only code that touches both worlds.

Servicers and drivers call these at the edge; inside, everything is a muser.records
dataclass. Signatures ride beside the records and are checked over canonical bytes.
"""

from __future__ import annotations

import numpy as np

from muser.canonical import CanonicalError, pack_f64s, pack_u32s, unpack_f64s, unpack_u32s
from muser.errors import TreeTopologyError
from muser.logprobs import TokenLogprobs
from muser.records import (
    Identity,
    RoundRequest,
    RoundResult,
    SessionOpen,
    Signed,
    request_of,
    result_of,
)
from muser.sampling import SamplingParams, SparseRow
from muser.wire import muser_v2_pb2 as pb


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        max_tokens=p.max_tokens,
        stop_tokens=list(p.stop_tokens),
        seed=p.seed,
        logprobs=p.logprobs,
    )


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidSamplingParamsError on values outside their ranges."""
    return SamplingParams(
        temperature=m.temperature,
        top_k=m.top_k,
        top_p=m.top_p,
        max_tokens=m.max_tokens,
        stop_tokens=tuple(m.stop_tokens),
        seed=m.seed,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
    )


def identity_to_pb(i: Identity) -> pb.ModelIdentity:
    return pb.ModelIdentity(
        model_digest=i.model_digest, tokenizer_digest=i.tokenizer_digest, vocab_size=i.vocab_size
    )


def identity_from_pb(m: pb.ModelIdentity) -> Identity:
    return Identity(m.model_digest, m.tokenizer_digest, m.vocab_size)


def open_to_pb(
    o: SessionOpen,
    epoch: int,
    signature: bytes,
    fragments: dict[bytes, bytes],
    resume: bytes = b"",
    resume_transcript: tuple[bytes, ...] = (),
) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(
        session_id=o.session_id,
        target=identity_to_pb(o.target),
        draft=identity_to_pb(o.draft),
        params=params_to_pb(o.params),
        prompt_digest=o.prompt_digest,
        proposer_key_id=o.proposer_key_id,
        epoch=epoch,
        capture_layers=list(o.capture_layers),
        genesis_head=o.genesis_head(),
        signature=signature,
        fragments=[pb.Fragment(digest=d, data=b) for d, b in fragments.items()],
        resume=resume,
        resume_transcript=list(resume_transcript),
    )


def open_from_pb(m: pb.OpenSessionRequest) -> SessionOpen:
    return SessionOpen(
        m.session_id,
        identity_from_pb(m.target),
        identity_from_pb(m.draft),
        params_from_pb(m.params),
        m.prompt_digest,
        m.proposer_key_id,
        tuple(m.capture_layers),
    )


def row_to_pb(q: SparseRow) -> pb.SparseRow:
    """A draft row as two packed little-endian arrays (u32 ids, f64 weights). The ids are in
    u32: the request's canonical encoding, signed before this, refuses any that is not."""
    return pb.SparseRow(ids=pack_u32s(np.asarray(q.ids)), weights=pack_f64s(q.weights))


def row_from_pb(m: pb.SparseRow, i: int) -> SparseRow:
    """The row `row_to_pb` packed; byte lengths that are not whole arrays are refused
    (values are checked later, with the round: `SparseRow.validate`)."""
    if len(m.ids) % 4 or len(m.weights) % 8:
        raise CanonicalError(
            f"draft row {i}: ids must be packed u32 (a multiple of 4 bytes) and weights packed "
            f"f64 (a multiple of 8 bytes), got {len(m.ids)} and {len(m.weights)} bytes"
        )
    return SparseRow(unpack_u32s(m.ids), unpack_f64s(m.weights))


def parents_from_pb(parents) -> tuple[int, ...]:
    """A tree's topology off the wire (sint32): a parent below -1 is no node, refused here
    (the canonical encoding writes parents + 1 as u32); the rest is checked with the round
    (`muser.tree.check_topology`)."""
    for i, parent in enumerate(parents):
        if parent < -1:
            raise TreeTopologyError(
                f"node {i}: parent {parent} is no node (an orphan); expected -1 (the root) or "
                f"an earlier node in [0, {i})"
            )
    return tuple(parents)


def request_to_pb(signed: Signed) -> pb.RoundRequest:
    r = request_of(signed)
    return pb.RoundRequest(
        session_id=r.session_id,
        round=r.round,
        epoch=r.epoch,
        expected_head=r.expected_head,
        frontier=r.frontier,
        drafts=list(r.drafts),
        q_rows=[row_to_pb(q) for q in r.q_rows],
        pre_state_digest=r.pre_state_digest,
        transcript_digests=list(r.transcript_digests),
        proposer_key_id=r.proposer_key_id,
        signature=signed.signature,
        decode_len=r.decode_len,
        parents=list(r.parents),
        lookup=list(r.lookup),
    )


def request_from_pb(m: pb.RoundRequest) -> Signed:
    """The canonical request re-derived from the fields, with the proposer's signature."""
    r = RoundRequest(
        m.session_id,
        m.round,
        m.epoch,
        m.expected_head,
        m.frontier,
        tuple(m.drafts),
        tuple(row_from_pb(q, i) for i, q in enumerate(m.q_rows)),
        m.pre_state_digest,
        tuple(m.transcript_digests),
        m.proposer_key_id,
        m.decode_len,
        parents_from_pb(m.parents),
        tuple(m.lookup),
    )
    return Signed(r.encode(), m.signature, r)


def result_to_pb(signed: Signed, timings: dict[str, float] | None = None) -> pb.RoundResult:
    r = result_of(signed)
    t = timings or {}
    return pb.RoundResult(
        session_id=r.session_id,
        round=r.round,
        epoch=r.epoch,
        prev_head=r.prev_head,
        request_digest=r.request_digest,
        frontier=r.frontier,
        drafts=list(r.drafts),
        accepted=r.accepted,
        next_frontier=r.next_frontier,
        post_state_digest=r.post_state_digest,
        transcript_digest=r.transcript_digest,
        capture_digests=list(r.capture_digests),
        head=r.head,
        verifier_key_id=r.verifier_key_id,
        signature=signed.signature,
        decoded=list(r.decoded),
        parents=list(r.parents),
        path=list(r.path),
        logprobs=[
            pb.TokenLogprobs(
                logprob=lp.logprob, top_ids=list(lp.top_ids), top_logprobs=list(lp.top_logprobs)
            )
            for lp in r.logprobs
        ],
        verify_s=t.get("verify_s", 0.0),
        wal_s=t.get("wal_s", 0.0),
        sign_s=t.get("sign_s", 0.0),
    )


def result_from_pb(m: pb.RoundResult) -> Signed:
    r = RoundResult(
        m.session_id,
        m.round,
        m.epoch,
        m.prev_head,
        m.request_digest,
        m.frontier,
        tuple(m.drafts),
        m.accepted,
        m.next_frontier,
        m.post_state_digest,
        m.transcript_digest,
        tuple(m.capture_digests),
        m.head,
        m.verifier_key_id,
        tuple(m.decoded),
        parents_from_pb(m.parents),
        tuple(m.path),
        tuple(
            TokenLogprobs(lp.logprob, tuple(lp.top_ids), tuple(lp.top_logprobs))
            for lp in m.logprobs
        ),
    )
    return Signed(r.encode(), m.signature, r)
