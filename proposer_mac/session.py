"""A proposer-side session: state rebuilt from the journal, requests built, results checked.

`check_result` is the proposer's half of the security story (DESIGN.md §6): a result is
accepted only if an enrolled verifier key signed exactly it, and every field agrees with the
request it answers and with what the proposer can recompute itself — the post-round MT
state (pre-round state advanced by the draws the decision implies), the transcript digest,
and the head chain. Anything else is refused and never emitted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from muser import keys
from muser.errors import RefusedError
from muser.mt19937 import Mt19937
from muser.records import (
    Identity,
    RoundRequest,
    RoundResult,
    SessionOpen,
    Signed,
    advance,
    draws_for_round,
    sha256,
    state_digest,
    tokens_bytes,
    transcript_chunks,
    transcript_digest,
)
from muser.round import clip_emission
from muser.sampling import SamplingParams, SparseRow


class ResultRejected(RefusedError):
    """A verifier result that does not check out; its tokens are never emitted."""


@dataclass
class ProposerSession:
    open: SessionOpen
    epoch: int
    prompt: list[int]
    draft_len: int
    transcript: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    """Tokens handed to clients (clipped at stop tokens / max tokens)."""
    head: bytes = b""
    state: Mt19937 | None = None
    next_round: int = 0
    done: bool = False
    prepared: Signed | None = None

    @classmethod
    def create(
        cls,
        prompt: list[int],
        params: SamplingParams,
        target: Identity,
        draft: Identity,
        proposer_key_id: str,
        draft_len: int,
        capture_layers: tuple[int, ...] = (),
        epoch: int = 1,
    ) -> ProposerSession:
        open_ = SessionOpen(
            os.urandom(16),
            target,
            draft,
            params,
            sha256(tokens_bytes(prompt)),
            proposer_key_id,
            capture_layers,
        )
        return cls.from_open(open_, epoch, prompt, draft_len)

    @classmethod
    def from_open(cls, open_: SessionOpen, epoch: int, prompt: list[int], draft_len: int):
        s = cls(open_, epoch, list(prompt), draft_len)
        s.transcript = list(prompt)
        s.head = open_.genesis_head()
        s.state = Mt19937.from_seed(open_.params.seed)
        return s

    @property
    def params(self) -> SamplingParams:
        return self.open.params

    @property
    def session_id(self) -> bytes:
        return self.open.session_id

    def fragments(self) -> dict[bytes, bytes]:
        """Every fragment a request of this session may name, by digest."""
        out = {sha256(c): c for c in transcript_chunks(self.transcript)}
        out[state_digest(self.state)] = self.state.to_bytes()
        out[self.open.prompt_digest] = tokens_bytes(self.prompt)
        return out

    def build_request(
        self, drafts: list[int], q_rows: list[SparseRow], private: Ed25519PrivateKey
    ) -> Signed:
        request = RoundRequest(
            self.session_id,
            self.next_round,
            self.epoch,
            self.head,
            self.transcript[-1],
            tuple(drafts),
            tuple(q_rows),
            state_digest(self.state),
            tuple(sha256(c) for c in transcript_chunks(self.transcript)),
            self.open.proposer_key_id,
        )
        body = request.encode()
        return Signed(body, private.sign(body))

    def check_result(
        self, signed_request: Signed, signed: Signed, verifiers: dict[str, Ed25519PublicKey]
    ) -> RoundResult:
        try:
            result = RoundResult.decode(signed.body)
        except RefusedError as exc:
            raise ResultRejected(f"result is not a canonical round result: {exc}") from exc
        key = verifiers.get(result.verifier_key_id)
        if key is None:
            raise ResultRejected(
                f"result signed by key {result.verifier_key_id!r}, which is not an enrolled "
                f"verifier (enrolled: {sorted(verifiers)})"
            )
        try:
            keys.verify(key, signed.body, signed.signature, f"round {result.round} result")
        except keys.SignatureError as exc:
            raise ResultRejected(str(exc)) from exc
        request = RoundRequest.decode(signed_request.body)
        depth = len(request.drafts)
        checks = [
            ("session", result.session_id, self.session_id),
            ("round", result.round, self.next_round),
            ("epoch", result.epoch, self.epoch),
            ("prev_head", result.prev_head, self.head),
            ("request_digest", result.request_digest, sha256(signed_request.body)),
            ("frontier", result.frontier, request.frontier),
            ("drafts", result.drafts, request.drafts),
        ]
        for name, got, expected in checks:
            if got != expected:
                raise ResultRejected(f"result {name} is {got!r}, expected {expected!r}")
        if not 0 <= result.accepted <= depth:
            raise ResultRejected(f"result accepted {result.accepted} drafts of {depth}")
        if not 0 <= result.next_frontier < self.open.target.vocab_size:
            raise ResultRejected(f"next frontier {result.next_frontier} outside the vocabulary")
        post = advance(self.state, draws_for_round(depth, result.accepted, self.params.greedy))
        if result.post_state_digest != state_digest(post):
            raise ResultRejected("result post-round MT state digest does not match the draws")
        if result.transcript_digest != transcript_digest(self.transcript + result.emitted()):
            raise ResultRejected("result transcript digest does not match the emitted tokens")
        if result.head != result.expected_head():
            raise ResultRejected("result head is not H(prev_head ‖ round record)")
        return result

    def apply(self, result: RoundResult) -> list[int]:
        """Advance past a checked, journaled result; return the tokens to emit."""
        depth = len(result.drafts)
        self.state = advance(
            self.state, draws_for_round(depth, result.accepted, self.params.greedy)
        )
        self.transcript += result.emitted()
        self.head = result.head
        self.next_round += 1
        self.prepared = None
        emission = clip_emission(
            result.emitted(), len(self.emitted), self.params.max_tokens, self.params.stop_tokens
        )
        self.emitted += emission.tokens
        self.done = emission.done
        return emission.tokens
