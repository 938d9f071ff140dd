"""A small in-test proposer: correctly signed requests drafted with the proposer's rule
(proposer_mac.drafting.Drafter), results checked against the head chain and the MT draws."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from muser import keys
from muser.backend import ModelBackend
from muser.mt19937 import Mt19937
from muser.records import (
    Identity,
    RoundRequest,
    RoundResult,
    SessionOpen,
    Signed,
    advance,
    sha256,
    state_digest,
    tokens_bytes,
    transcript_chunks,
    transcript_digest,
)
from muser.round import clip_emission, plan_depth
from muser.sampling import SamplingParams
from muser.tree_width import full_parents
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from proposer_mac.drafting import Drafter


def identity_of(backend: ModelBackend) -> Identity:
    i = backend.identity
    return Identity(i.model_digest, i.tokenizer_digest, i.vocab_size)


class Stream:
    """One Rounds call, driven with write/read."""

    def __init__(self, stub: pb_grpc.VerifierStub) -> None:
        self.call = stub.Rounds()
        self.decisions: list[pb.Decision] = []
        """The early decisions the last round trip saw before its answer."""

    async def send(self, **kind) -> None:
        await self.call.write(pb.ProposerMessage(**kind))

    async def attach(self, session_id: bytes, epoch: int) -> None:
        await self.send(attach=pb.Attach(session_id=session_id, epoch=epoch))

    async def fragment(self, digest: bytes, data: bytes) -> None:
        await self.send(fragment=pb.Fragment(digest=digest, data=data))

    async def read(self) -> pb.VerifierMessage:
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            raise AssertionError("the verifier closed the stream")
        return msg

    async def round_trip(self, request: pb.RoundRequest) -> tuple[pb.VerifierMessage, list]:
        """Send one request; return the result/error message and the fragments before it.
        The early decisions before it are kept in `decisions` (a result's must agree)."""
        await self.send(request=request)
        fragments, self.decisions = [], []
        while True:
            msg = await self.read()
            kind = msg.WhichOneof("kind")
            if kind == "decision":
                self.decisions.append(msg.decision)
            elif kind == "fragment":
                fragments.append(msg.fragment)
            else:
                if kind == "result":
                    check_decision(self.decisions, msg.result)
                return msg, fragments

    async def close(self) -> None:
        await self.call.done_writing()
        self.call.cancel()


def check_decision(decisions: list, result: pb.RoundResult) -> None:
    """A computed round's result follows one early decision that says what it says; a retry
    answered from the log follows none."""
    if not decisions:
        return
    assert len(decisions) == 1, decisions
    d = decisions[0]
    told = (d.round, d.accepted, d.next_frontier, list(d.decoded), list(d.capture_digests),
            list(d.path))  # fmt: skip
    assert told == (
        result.round,
        result.accepted,
        result.next_frontier,
        list(result.decoded),
        list(result.capture_digests),  # named before the result is signed (send-on-decision)
        list(result.path),  # a tree's accepted path
    )


@dataclass
class LaneClient:
    stub: pb_grpc.VerifierStub
    key: Ed25519PrivateKey
    verifier_public: Ed25519PublicKey
    target: Identity
    draft: ModelBackend
    params: SamplingParams
    prompt: list[int]
    draft_len: int = 3
    q_top_k: int = 5
    epoch: int = 1
    capture_layers: tuple[int, ...] = ()
    decode_len: int = 1
    """Tokens a draftless round asks the verifier to decode (capped at what remains)."""
    lookup: tuple[int, ...] = ()
    """The lookup rule a draftless round carries (`RoundRequest.lookup`); (): none."""
    tree_shape: list[int] = field(default_factory=list)
    """Tree rounds of this shape (`Drafter.tree_steps`: `draft` must be a sequence of a torch
    draft); empty: chains."""
    session_id: bytes = field(default_factory=lambda: os.urandom(16))
    results: list[Signed] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafter = Drafter(self.draft, self.params, self.q_top_k)
        self.open = SessionOpen(
            self.session_id,
            self.target,
            identity_of(self.draft),
            self.params,
            sha256(tokens_bytes(self.prompt)),
            keys.key_id(self.key.public_key()),
            tuple(self.capture_layers),
        )
        self.transcript = list(self.prompt)
        self.out: list[int] = []
        self.head = self.open.genesis_head()
        self.mt = Mt19937.from_seed(self.params.seed)
        self.next_round = 0
        self.done = False

    @property
    def key_id(self) -> str:
        return keys.key_id(self.key.public_key())

    def open_pb(self, *, open_: SessionOpen | None = None, epoch: int | None = None,
                signer: Ed25519PrivateKey | None = None,
                fragments: dict[bytes, bytes] | None = None, resume: bytes = b"",
                resume_transcript: tuple[bytes, ...] = (),
                signed_resume: bytes | None = None) -> pb.OpenSessionRequest:  # fmt: skip
        """The open; with `resume`, a resume point (`signed_resume`: what the signature
        covers instead, to forge one)."""
        o = open_ or self.open
        at = self.epoch if epoch is None else epoch
        covered = resume if signed_resume is None else signed_resume
        signature = (signer or self.key).sign(o.signed_message(at, covered))
        if fragments is None:
            fragments = {o.prompt_digest: tokens_bytes(self.prompt)}
        return convert.open_to_pb(o, at, signature, fragments, resume, resume_transcript)

    def resume_point(self) -> tuple[bytes, tuple[bytes, ...], dict[bytes, bytes]]:
        """Like the proposer's: the last result, the transcript's chunk digests, and the
        fragments (chunks, MT state, prompt) an open resuming after it carries."""
        chunks = tuple(sha256(c) for c in transcript_chunks(self.transcript))
        fragments = {**self.fragments(), self.open.prompt_digest: tokens_bytes(self.prompt)}
        return self.results[-1].encode(), chunks, fragments

    async def resume_session(self, **kw) -> pb.OpenSessionResponse:
        resume, chunks, fragments = self.resume_point()
        kw.setdefault("resume", resume)
        kw.setdefault("resume_transcript", chunks)
        kw.setdefault("fragments", fragments)
        return await self.stub.OpenSession(self.open_pb(**kw))

    async def open_session(self, **kw) -> pb.OpenSessionResponse:
        return await self.stub.OpenSession(self.open_pb(**kw))

    async def attach(self) -> Stream:
        stream = Stream(self.stub)
        await stream.attach(self.session_id, self.epoch)
        return stream

    def fragments(self) -> dict[bytes, bytes]:
        out = {sha256(c): c for c in transcript_chunks(self.transcript)}
        out[state_digest(self.mt)] = self.mt.to_bytes()
        return out

    def draft_request(self) -> RoundRequest:
        remaining = self.params.max_tokens - len(self.out)
        depth = plan_depth(self.draft_len, remaining)
        if self.tree_shape:
            depth = min(len(self.tree_shape), remaining - 1)
            template = full_parents(self.tree_shape[:depth])
            steps = self.drafter.tree_steps(self.transcript, self.mt, template)
            proposal = self.drafter.run(steps)
        else:
            proposal = self.drafter.draft(self.transcript, self.mt, depth)
        return RoundRequest(
            self.session_id,
            self.next_round,
            self.epoch,
            self.head,
            self.transcript[-1],
            tuple(proposal.drafts),
            tuple(proposal.q_rows),
            state_digest(self.mt),
            tuple(sha256(c) for c in transcript_chunks(self.transcript)),
            self.key_id,
            1 if depth else min(self.decode_len, remaining),
            tuple(proposal.parents),
            () if proposal.drafts else self.lookup,
        )

    def sign(self, request: RoundRequest, key: Ed25519PrivateKey | None = None) -> pb.RoundRequest:
        body = request.encode()
        return convert.request_to_pb(Signed(body, (key or self.key).sign(body)))

    def accept(self, request: RoundRequest, msg: pb.VerifierMessage) -> RoundResult:
        """Check a result like a proposer does, then advance past it."""
        if msg.WhichOneof("kind") != "result":
            raise AssertionError(f"expected a result, got {msg}")
        signed = convert.result_from_pb(msg.result)
        keys.verify(self.verifier_public, signed.body, signed.signature, "result")
        result = RoundResult.decode(signed.body)
        assert result.parents == request.parents
        post = advance(self.mt, result.draws(self.params.greedy))
        checks = [
            (result.prev_head, self.head),
            (result.head, result.expected_head()),
            (result.request_digest, request.digest()),
            (result.post_state_digest, state_digest(post)),
            (result.transcript_digest, transcript_digest(self.transcript + result.emitted())),
        ]
        for got, expected in checks:
            if got != expected:
                raise AssertionError(f"result field {got.hex()} != {expected.hex()}")
        emission = clip_emission(
            result.emitted(), len(self.out), self.params.max_tokens, self.params.stop_tokens
        )
        self.mt = post
        self.transcript += result.emitted()
        self.out += emission.tokens
        self.done = emission.done
        self.head = result.head
        self.next_round += 1
        self.results.append(signed)
        return result

    async def step(self, stream: Stream) -> RoundResult:
        request = self.draft_request()
        msg, _ = await stream.round_trip(self.sign(request))
        result = self.accept(request, msg)
        assert len(stream.decisions) == 1, "a computed round's result follows its decision"
        return result

    async def run(self, stream: Stream, rounds: int | None = None) -> None:
        count = 0
        while not self.done and (rounds is None or count < rounds):
            await self.step(stream)
            count += 1
