"""A proposer-side session: state rebuilt from the journal, requests built, results checked.

`check_result` is the proposer's half of the security story (docs/design.md §7): a result is
accepted only if an enrolled verifier key signed exactly it, and every field agrees with the
request it answers and with what the proposer can recompute itself — the post-round MT
state (pre-round state advanced by the draws the decision implies), the transcript digest,
and the head chain. Anything else is refused and never emitted.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys
from muser.errors import MuserError, RefusedError, TreeTopologyError
from muser.logprobs import TokenLogprobs
from muser.lookup import PromptLookup
from muser.mt19937 import Mt19937
from muser.records import (
    Identity,
    RoundRequest,
    RoundResult,
    SessionOpen,
    Signed,
    advance,
    draws_for_round,
    request_of,
    result_of,
    sha256,
    state_digest,
    tokens_bytes,
    transcript_chunks,
    transcript_digest,
)
from muser.round import clip_emission
from muser.sampling import SamplingParams, SparseRow
from muser.tree import check_path, tree_draws
from muser.tree_width import TreePolicy
from muser.width import FixedWidth, WidthPolicy


@dataclass(frozen=True)
class Outcome:
    """The round in flight as its early decision says it ends (`ProposerSession.predict`)."""

    round: int
    emitted: list[int]
    produced: int
    """Tokens the session had emitted before it."""
    head: bytes
    """The head its signed result must carry."""
    transcript: list[int]
    state: Mt19937
    """The MT state after its draws."""


class ResultRejected(RefusedError):
    """A verifier result that does not check out; its tokens are never emitted."""


class SessionFailed(MuserError):
    """A session that failed before this daemon started (FAILED in its journal): a client
    that reconnects gets its durable tokens, then this."""


@dataclass
class ProposerSession:
    open: SessionOpen
    epoch: int
    prompt: list[int]
    draft_len: int
    """As journaled: the D the session asked for, 0 for the lane's width policy."""
    width: WidthPolicy
    """Chooses each round's D (`muser.width`); a speed policy, never journaled."""
    transcript: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    """Tokens handed to clients (clipped at stop tokens / max tokens)."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With a session that asked for logprobs, one per emitted token, as the verifier signed
    them (the target's own, muser.logprobs)."""
    head: bytes = b""
    state: Mt19937 | None = None
    next_round: int = 0
    done: bool = False
    prepared: Signed | None = None
    ahead: Signed | None = None
    """The next round's request, journaled and sent on the early decision of the round in
    flight (lane.send_on_decision): it goes next if that round's result carries the head it
    expects, and is void otherwise."""
    last_result: Signed | None = None
    """The last round's signed result, once COMMITTED is journaled: the resume point an open
    carries, so a verifier that does not hold it (another node, a lost commit log) can go on
    from it."""
    homes: list[str] = field(default_factory=list)
    """Every pool verifier it lived on, in order (journaled MOVED; its home last)."""
    signer: str | None = None
    """The key id of the verifier that answered its last open: the only key whose results
    it takes (a result another verifier signed for one of its rounds is refused)."""
    tree: TreePolicy | None = None
    """Chooses the shape of each tree its rounds draft (lane.tree_nodes and lane.width,
    `muser.tree_width`); None: chains. A speed policy, never journaled."""
    lookup: tuple[int, ...] = ()
    """Its n-gram draft's lookup rule (min_n, max_n) when lane.lookup_stop holds: its decode
    rounds end where that draft would propose (`RoundRequest.lookup`), when `decode_lookup`
    says so; () for a model draft. A speed choice, never journaled."""
    lookup_offered: bool = False
    """Whether the verifier that answered its last open offers `lookup-stop`."""
    _checked: tuple[RoundResult, Mt19937] | None = field(default=None, repr=False)
    """The last result check_result passed and the MT state after it."""

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
        width: WidthPolicy | None = None,
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
        return cls.from_open(open_, epoch, prompt, draft_len, width)

    @classmethod
    def from_open(
        cls,
        open_: SessionOpen,
        epoch: int,
        prompt: list[int],
        draft_len: int,
        width: WidthPolicy | None = None,
    ):
        width = FixedWidth(draft_len) if width is None else width
        s = cls(open_, epoch, list(prompt), draft_len, width)
        s.transcript = list(prompt)
        s.head = open_.genesis_head()
        s.state = Mt19937.from_seed(open_.params.seed)
        return s

    @property
    def params(self) -> SamplingParams:
        return self.open.params

    @property
    def decode_lookup(self) -> tuple[int, ...]:
        """The lookup rule its next decode round carries: its own (`lookup`) where the verifier
        offers `lookup-stop` and the session drafts chains at all now (its width policy's D >
        0), so a match the round stops at is drafted next; () else — stopping a decode round
        at a match that no round drafts would only cost round trips."""
        if not (self.lookup and self.lookup_offered) or self.tree is not None:
            return ()
        return self.lookup if self.width.choose(self.params.max_tokens) > 0 else ()

    @property
    def session_id(self) -> bytes:
        return self.open.session_id

    def fragments(self) -> dict[bytes, bytes]:
        """Every fragment a request of this session may name, by digest."""
        out = {sha256(c): c for c in transcript_chunks(self.transcript)}
        out[state_digest(self.state)] = self.state.to_bytes()
        out[self.open.prompt_digest] = tokens_bytes(self.prompt)
        return out

    def resume_point(self) -> tuple[bytes, tuple[bytes, ...], dict[bytes, bytes]]:
        """What an open carries to resume after the last committed round: its signed result,
        the transcript's chunk digests in order, and the fragments (chunks, MT state,
        prompt). At genesis: nothing but the prompt."""
        prompt = {self.open.prompt_digest: tokens_bytes(self.prompt)}
        if self.last_result is None:
            return b"", (), prompt
        chunks = tuple(sha256(c) for c in transcript_chunks(self.transcript))
        return self.last_result.encode(), chunks, self.fragments()

    def build_request(
        self,
        drafts: list[int],
        q_rows: list[SparseRow],
        private: keys.SigningKey,
        decode_len: int = 1,
        after: Outcome | None = None,
        parents: Sequence[int] = (),
    ) -> Signed:
        """The signed request of the next round; with `after`, of the round after the one in
        flight, on that round's predicted outcome (`predict`). A decode round carries
        `decode_lookup`."""
        round_, head, transcript, state = (
            (self.next_round, self.head, self.transcript, self.state)
            if after is None
            else (after.round + 1, after.head, after.transcript, after.state)
        )
        request = RoundRequest(
            self.session_id,
            round_,
            self.epoch,
            head,
            transcript[-1],
            tuple(drafts),
            tuple(q_rows),
            state_digest(state),
            tuple(sha256(c) for c in transcript_chunks(transcript)),
            self.open.proposer_key_id,
            decode_len,
            tuple(int(p) for p in parents),
            () if drafts else self.decode_lookup,
        )
        return Signed.of(request, private.sign)

    def predict(
        self,
        accepted: int,
        decoded: Sequence[int],
        next_frontier: int,
        capture_digests: Sequence[bytes] = (),
        path: Sequence[int] = (),
    ) -> Outcome | None:
        """What the round in flight (`prepared`) leaves if the verifier decided it so (its
        early decision; a tree's names its accepted `path`): the head its result chains to,
        the transcript and the MT state after it. The result's digests are the proposer's own
        to compute, but for its capture fragments' (the target's rows), which the decision
        names: one per layer the session captures. None when that decision cannot be the
        result of this request."""
        if self.prepared is None:
            return None
        if len(capture_digests) != len(self.open.capture_layers):
            return None
        request = request_of(self.prepared)
        depth = len(request.drafts)
        if request.is_tree:
            try:
                check_path(request.parents, path)
            except TreeTopologyError:
                return None
            if decoded or accepted != len(path):
                return None
            emitted = [*(request.drafts[i] for i in path), int(next_frontier)]
            post = advance(self.state, tree_draws(request.parents, path, self.params.greedy))
        else:
            if not 0 <= accepted <= depth or (decoded and depth) or path:
                return None
            emitted = [*request.drafts[:accepted], *decoded, int(next_frontier)]
            post = self._after(depth, accepted, len(emitted))
        transcript = [*self.transcript, *emitted]
        result = RoundResult(
            self.session_id,
            self.next_round,
            self.epoch,
            self.head,
            sha256(self.prepared.body),
            request.frontier,
            request.drafts,
            accepted,
            int(next_frontier),
            state_digest(post),
            transcript_digest(transcript),
            tuple(bytes(d) for d in capture_digests),
            b"",
            "",
            tuple(int(t) for t in decoded),
            tuple(request.parents),
            tuple(int(i) for i in path),
        )
        return Outcome(
            self.next_round, emitted, len(self.emitted), result.expected_head(), transcript, post
        )

    def _after(self, depth: int, accepted: int, emitted: int) -> Mt19937:
        """The MT state after the round in flight, had it `depth` drafts, `accepted` of them,
        and emitted `emitted` tokens (the draws docs/design.md §2 says it consumes)."""
        draws = draws_for_round(depth, accepted, self.params.greedy, emitted)
        return advance(self.state, draws)

    def check_result(
        self, signed_request: Signed, signed: Signed, verifiers: dict[str, Ed25519PublicKey]
    ) -> RoundResult:
        try:
            result = result_of(signed)
        except RefusedError as exc:
            raise ResultRejected(f"result is not a canonical round result: {exc}") from exc
        key = verifiers.get(result.verifier_key_id)
        if self.signer is not None and result.verifier_key_id != self.signer:
            raise ResultRejected(
                f"result signed by verifier key {result.verifier_key_id!r}; the session lives "
                f"on the verifier with key {self.signer!r} (epoch {self.epoch})"
            )
        if key is None:
            raise ResultRejected(
                f"result signed by key {result.verifier_key_id!r}, which is not an enrolled "
                f"verifier (enrolled: {sorted(verifiers)})"
            )
        try:
            keys.verify(key, signed.body, signed.signature, f"round {result.round} result")
        except keys.SignatureError as exc:
            raise ResultRejected(str(exc)) from exc
        request = request_of(signed_request)
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
        self._check_tree(request, result)
        emitted = result.emitted()
        vocab = self.open.target.vocab_size
        if any(not 0 <= t < vocab for t in (*result.decoded, result.next_frontier)):
            raise ResultRejected(f"result tokens {emitted} reach outside the vocabulary")
        self._check_decoded(request, result)
        self._check_logprobs(result, len(emitted), vocab)
        post = advance(self.state, result.draws(self.params.greedy))
        if result.post_state_digest != state_digest(post):
            raise ResultRejected("result post-round MT state digest does not match the draws")
        if result.transcript_digest != transcript_digest(self.transcript + emitted):
            raise ResultRejected("result transcript digest does not match the emitted tokens")
        if result.head != result.expected_head():
            raise ResultRejected("result head is not H(prev_head ‖ round record)")
        self._checked = (result, post)  # apply() takes the post-round state from here
        return result

    def _check_logprobs(self, result: RoundResult, emitted: int, vocab: int) -> None:
        """A session that asked for logprobs gets one per emitted token, each with as many
        alternatives as it asked (the vocabulary permitting), ids inside the vocabulary and
        log-probabilities <= 0; a session that did not gets none."""
        k = self.params.logprobs
        if k is None:
            if result.logprobs:
                raise ResultRejected("result carries logprobs; the session asked for none")
            return
        if len(result.logprobs) != emitted:
            raise ResultRejected(
                f"result carries {len(result.logprobs)} logprobs for {emitted} emitted tokens"
            )
        for i, lp in enumerate(result.logprobs):
            values = (lp.logprob, *lp.top_logprobs)
            ids = lp.top_ids
            if len(set(ids)) != min(k, vocab) or any(not 0 <= t < vocab for t in ids):
                raise ResultRejected(
                    f"result logprobs[{i}] names tokens {list(lp.top_ids)}; expected "
                    f"{min(k, vocab)} distinct ids below {vocab}"
                )
            if any(math.isnan(v) or v > 0.0 for v in values):
                raise ResultRejected(f"result logprobs[{i}] holds {values}: not log-probabilities")

    def _check_tree(self, request: RoundRequest, result: RoundResult) -> None:
        """A tree round's result carries its request's topology and a path of it, accepted
        node by node (`accepted` its length); a chain's carries neither."""
        if result.parents != request.parents:
            raise ResultRejected(
                f"result topology {list(result.parents)}; the request's is {list(request.parents)}"
            )
        if not result.is_tree:
            if result.path:
                raise ResultRejected(f"result path {list(result.path)} in a chain round")
            return
        try:
            check_path(result.parents, result.path)
        except RefusedError as exc:
            raise ResultRejected(f"result {exc}") from exc
        if result.accepted != len(result.path) or result.decoded:
            raise ResultRejected(
                f"tree result accepts {result.accepted} along path {list(result.path)} and "
                f"decodes {list(result.decoded)}; expected the path's length and nothing"
            )

    def _check_decoded(self, request: RoundRequest, result: RoundResult) -> None:
        """A round with drafts decodes nothing; a decode round emits exactly the tokens it
        asked for, or fewer ending at its first stop token."""
        emitted, stops = result.emitted(), self.params.stop_tokens
        if request.drafts:
            if result.decoded:
                raise ResultRejected(
                    f"result decoded {list(result.decoded)} in a round with drafts"
                )
            return
        early = any(t in stops for t in emitted[:-1])
        short = len(emitted) < request.decode_len and emitted[-1] not in stops
        if request.lookup:
            early, short = self._check_lookup_stop(request, emitted, early, short)
        if len(emitted) > request.decode_len or early or short:
            rule = f" or where lookup {list(request.lookup)} proposes" if request.lookup else ""
            raise ResultRejected(
                f"decode round asked for {request.decode_len} tokens (ending early only at a "
                f"stop token {list(stops)}{rule}); the result emits {emitted}"
            )

    def _check_lookup_stop(
        self, request: RoundRequest, emitted: list[int], early: bool, short: bool
    ) -> tuple[bool, bool]:
        """A lookup round (`RoundRequest.lookup`) ends early exactly after its first token
        that prompt lookup extends: (early, short) with that rule applied — `early` when an
        earlier token was one, `short` when the round stopped short at no match."""
        lookup = PromptLookup(*request.lookup, self.transcript)
        matched = []
        for token in emitted:
            lookup.push(int(token))
            matched.append(lookup.proposal() is not None)
        early = early or any(matched[:-1])
        return early, short and not matched[-1]

    @property
    def moves(self) -> int:
        """Times it moved to another verifier (its first placement is not a move)."""
        return max(0, len(self.homes) - 1)

    @property
    def home(self) -> str | None:
        """The pool verifier it lives on (None: [verifier], for a session journaled before
        pools)."""
        return self.homes[-1] if self.homes else None

    def place(self, home: str, epoch: int) -> None:
        """It lives on `home` from `epoch` on (as MOVED journals it)."""
        self.epoch = epoch
        self.homes.append(home)
        self.signer = None  # the next open says whose results it takes

    def resign(self, signed: Signed, private: keys.SigningKey) -> Signed:
        """The request `signed`, the same in all but its epoch: the session's now (a move)."""
        request = dataclasses.replace(request_of(signed), epoch=self.epoch)
        return Signed.of(request, private.sign)

    def forget_draws(self) -> None:
        """The session ended: nothing more is drawn, so drop the draw caches its MT state
        holds and any checked result's state (what an ended session kept costs memory for
        each of limits.finished_sessions)."""
        self._checked = None
        if self.state is not None:
            self.state.compact()

    def apply(self, result: RoundResult) -> list[int]:
        """Advance past a checked, journaled result; return the tokens to emit."""
        emitted = result.emitted()
        checked = self._checked
        if checked is not None and checked[0] is result:
            self.state = checked[1]
        else:  # replayed from the journal at recovery: advance here
            self.state = advance(self.state, result.draws(self.params.greedy))
        self._checked = None
        self.transcript += emitted
        self.head = result.head
        self.next_round += 1
        self.prepared = None
        emission = clip_emission(
            emitted, len(self.emitted), self.params.max_tokens, self.params.stop_tokens
        )
        self.emitted += emission.tokens
        self.logprobs += result.logprobs[: len(emission.tokens)]
        self.done = emission.done
        return emission.tokens
