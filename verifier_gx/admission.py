"""What an open or a round request must satisfy before anything is computed or written.

Pure checks over plain records and the session state; each raises the one domain error the
servicer maps to a gRPC status, with a message saying what was received and what was
expected. Nothing here draws from an MT state it keeps or touches the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster_config.schema import Limits
from muser.backend import ModelIdentity
from muser.canonical import CanonicalError
from muser.errors import (
    CaptureLayerError,
    ContextOverflowError,
    DecodeLengthError,
    DraftOverrunError,
    DraftZeroProbabilityError,
    FragmentMismatchError,
    FrontierMismatchError,
    InvalidOverrideError,
    InvalidPromptError,
    InvalidSamplingParamsError,
    LookupRuleError,
    MissingFragmentsError,
    ModelMismatchError,
    RowCountError,
    TokenOutOfVocabularyError,
    TreeUnsupportedError,
)
from muser.lookup import check_lookup_n
from muser.records import (
    RoundRequest,
    SessionOpen,
    sha256,
    state_digest,
    tokens_from_bytes,
    transcript_chunks,
)
from muser.sampling import SamplingParams, check_stop_tokens
from muser.tree import check_topology, replay_tree, validate_request
from muser.verify import replay_drafts
from verifier_gx.fragments import FragmentStage
from verifier_gx.journal import short
from verifier_gx.replay import SessionState


def check_identities(
    o: SessionOpen, target: ModelIdentity, qualified_draft: tuple[str, str] | None = None
) -> None:
    """Target identity must be the loaded target's. When the lane's receipt names a draft
    (`(model digest, tokenizer digest)`) the draft must be that one: qualification compared
    the two vocabularies token by token (`muser.vocabulary`). Without one, the draft's
    vocabulary digest must be the target's. Embedding sizes may differ either way."""
    if qualified_draft is not None and (
        o.draft.model_digest,
        o.draft.tokenizer_digest,
    ) != tuple(qualified_draft):
        raise ModelMismatchError(
            f"draft model digest {o.draft.model_digest!r} is not the draft this lane was "
            f"qualified with: {qualified_draft[0]!r} (run `muser qualify` for the new draft)"
        )
    pairs = [
        ("target model digest", o.target.model_digest, target.model_digest),
        ("target tokenizer digest", o.target.tokenizer_digest, target.tokenizer_digest),
        ("target vocab size", o.target.vocab_size, target.vocab_size),
    ]
    if qualified_draft is None:
        pairs.append(("draft tokenizer digest", o.draft.tokenizer_digest, target.tokenizer_digest))
    for what, got, expected in pairs:
        if got != expected:
            raise ModelMismatchError(
                f"{what} {got!r} in the request differs from the verifier's loaded target: "
                f"{expected!r}"
            )


def check_qualified_capture(o: SessionOpen, qualified: Sequence[int] | None) -> None:
    """A session asks for the capture layers its lane was qualified with (the receipt binds
    them: lane.capture_layers, or a conditioned draft's own), none other."""
    if qualified is not None and sorted(set(o.capture_layers)) != sorted(set(qualified)):
        raise CaptureLayerError(
            f"capture layers {list(o.capture_layers)} requested; this lane was qualified with "
            f"{list(qualified)} (lane.capture_layers, or the conditioned draft's own): open the "
            "session with those, or run `muser qualify` for the new ones"
        )


def check_params(
    o: SessionOpen, limits: Limits, vocab: int, num_layers: int | None, can_capture: bool = True
) -> None:
    if o.params.max_tokens > limits.max_tokens:
        raise InvalidSamplingParamsError(
            f"max_tokens {o.params.max_tokens} exceeds limits.max_tokens {limits.max_tokens}"
        )
    check_stop_tokens(o.params, vocab)
    if o.capture_layers and not can_capture:
        raise CaptureLayerError(
            f"capture layers {list(o.capture_layers)} requested, but this verifier's target "
            "backend cannot capture hidden rows: open the session without capture layers"
        )
    for layer in o.capture_layers:
        if num_layers is not None and not 0 <= layer < num_layers:
            raise CaptureLayerError(
                f"capture layer {layer} outside [0, {num_layers}) decoder layers"
            )


def read_prompt(o: SessionOpen, held: Callable[[bytes], bytes | None], vocab: int) -> list[int]:
    """The prompt, from `held` (the open's fragments, hash-checked, then what the verifier
    holds: `SessionManager.lookup`)."""
    data = held(o.prompt_digest)
    if data is None:
        raise MissingFragmentsError(
            f"the prompt fragment {o.prompt_digest.hex()} is neither in the request nor held",
            [o.prompt_digest],
        )
    if not data or len(data) % 4:
        raise InvalidPromptError(
            f"prompt fragment of {len(data)} bytes; expected a non-empty whole number of u32 "
            f"token ids"
        )
    prompt = tokens_from_bytes(data)
    bad = [t for t in prompt if t >= vocab]
    if bad:
        raise TokenOutOfVocabularyError(
            f"prompt token {bad[0]} outside the vocabulary [0, {vocab})"
        )
    return prompt


def check_room(prompt_len: int, params: SamplingParams, context_length: int) -> None:
    """The longest KV a session can need (prompt + max_tokens - 1: the last round never
    drafts past max_tokens) must fit the target's context window."""
    need = prompt_len + params.max_tokens - 1
    if need > context_length:
        raise ContextOverflowError(
            f"a prompt of {prompt_len} tokens with max_tokens {params.max_tokens} needs "
            f"{need} positions; the target's context window is {context_length}"
        )


def check_closure(state: SessionState, request: RoundRequest, stage: FragmentStage) -> None:
    """Every fragment the request names is derived from the session or held and consistent."""
    for i, d in enumerate(request.transcript_digests):
        if len(d) != 32:
            raise CanonicalError(
                f"transcript digest {i} is {len(d)} bytes; expected a 32-byte SHA-256"
            )
    chunks = [sha256(c) for c in transcript_chunks(state.transcript)]
    mt_digest = state_digest(state.mt)
    named = [("pre-round MT state", request.pre_state_digest, mt_digest)]
    named += [
        (f"transcript chunk {i}", d, chunks[i] if i < len(chunks) else None)
        for i, d in enumerate(request.transcript_digests)
    ]
    derived = {mt_digest, *chunks}
    missing = []
    for what, digest, expected in named:
        if digest == expected:
            continue
        if digest not in derived:  # held content the session derives is never re-requested
            data = stage.get(digest)
            if data is None:
                missing.append(digest)
                continue
            FragmentStage.check(digest, data)
        held = expected.hex() if expected is not None else "none (past the transcript's end)"
        raise FragmentMismatchError(
            f"{what}: fragment {digest.hex()} disagrees with the committed session, whose "
            f"{what} digest is {held}"
        )
    if missing:
        raise MissingFragmentsError(
            f"{len(missing)} fragment(s) named by round {request.round} are not held: "
            + ", ".join(d.hex() for d in missing),
            missing,
        )
    if len(request.transcript_digests) != len(chunks):
        raise FragmentMismatchError(
            f"the request names {len(request.transcript_digests)} transcript chunks; the "
            f"committed transcript of {len(state.transcript)} tokens has {len(chunks)}"
        )
    if request.frontier != state.transcript[-1]:
        raise FrontierMismatchError(
            f"frontier {request.frontier} received; the committed transcript ends with "
            f"{state.transcript[-1]}"
        )


def check_decode(state: SessionState, request: RoundRequest, max_decode_len: int) -> None:
    """A round's decode_len (verifier_gx/decode.py): 1 with drafts; without, at most what
    the session may still emit and the lane's `decode_len` (a capturing session's decode
    round captures every step)."""
    k, depth, sid = request.decode_len, len(request.drafts), short(state.session_id)
    if k < 1:
        raise DecodeLengthError(f"decode_len must be >= 1, got {k}")
    if depth and k != 1:
        raise DecodeLengthError(
            f"a round with {depth} drafts decodes nothing more: decode_len must be 1, got {k}"
        )
    if k > max_decode_len:
        raise DecodeLengthError(
            f"decode_len {k} received; this verifier's lane.decode_len allows at most "
            f"{max_decode_len}"
        )
    if k > state.remaining:
        raise DecodeLengthError(
            f"decode_len {k} received; session {sid} may emit {state.remaining} more tokens"
        )
    if request.lookup:
        check_lookup_rule(request)


def check_lookup_rule(request: RoundRequest) -> None:
    """A decode round that ends where prompt lookup proposes: no drafts (the proposer drafts
    the round after it), (min_n, max_n) within muser.lookup's bounds."""
    if request.drafts:
        raise LookupRuleError(
            f"a round with {len(request.drafts)} drafts carries lookup {list(request.lookup)}; "
            "only a decode round (no drafts) ends at a lookup match"
        )
    try:
        check_lookup_n(*request.lookup, what="lookup")
    except InvalidOverrideError as exc:
        raise LookupRuleError(str(exc)) from exc


def check_drafts(
    state: SessionState, request: RoundRequest, vocab: int, max_drafts: int = 64
) -> None:
    """Every geometry and value check, then the drafting replay (docs/design.md §2 step 1; a
    tree round's: `check_tree`)."""
    depth = len(request.drafts)
    if len(request.q_rows) != depth:
        raise RowCountError(f"{depth} drafts need {depth} draft rows, got {len(request.q_rows)}")
    if depth > max_drafts:
        raise DraftOverrunError(
            f"{depth} drafts received; this verifier's lane takes at most {max_drafts} a "
            "round (lane.draft_len_max)"
        )
    room = max(0, state.remaining - 1)
    if depth > room:
        raise DraftOverrunError(
            f"{depth} drafts received; the session may emit {state.remaining} more tokens, so "
            f"at most {room} drafts"
        )
    for i, token in enumerate(request.drafts):
        if not 0 <= token < vocab:
            raise TokenOutOfVocabularyError(
                f"draft {i} token {token} outside the vocabulary [0, {vocab})"
            )
    for i, (token, row) in enumerate(zip(request.drafts, request.q_rows, strict=True)):
        row.validate(vocab, f"draft row {i}")
        if row.probability(token) <= 0.0:
            raise DraftZeroProbabilityError(
                f"draft {i} token {token} has draft probability q = 0 in its row"
            )
    replay_drafts(state.mt, request.drafts, request.q_rows, state.params.greedy)


def check_tree(
    state: SessionState,
    request: RoundRequest,
    vocab: int,
    max_nodes: int,
    judges_trees: bool,
    captures_trees: bool = False,
) -> None:
    """A tree round (docs/design.md §3): judged here at all, its topology and rows well formed
    (`muser.tree.validate_request`: cycles, orphans, duplicate siblings, too many nodes, rows
    that do not fit), deep enough for nothing past what the session may still emit, and the
    drafting draws replayed (`muser.tree.replay_tree`). At most `max_nodes`
    (lane.tree_nodes) nodes; a capturing session's only where `captures_trees`."""
    sid = short(state.session_id)
    if not judges_trees:
        raise TreeUnsupportedError(
            f"a tree round received for session {sid}; this verifier judges chains only "
            "(trees need lane.tree_nodes > 0 and a torch target with a KV per session)"
        )
    if state.open.capture_layers and not captures_trees:
        raise TreeUnsupportedError(
            f"a tree round received for session {sid}, which captures layers "
            f"{list(state.open.capture_layers)}; this verifier's target keeps the rows of "
            "chains only"
        )
    if request.decode_len != 1:
        raise DecodeLengthError(f"a tree round decodes nothing more: decode_len must be 1, got "
                                f"{request.decode_len}")  # fmt: skip
    check_topology(request.parents, len(request.drafts), max_nodes)  # before rows are placed
    tree = request.tree
    validate_request(request.frontier, tree, vocab, max_nodes)
    depth, room = max(len(tree.path(i)) for i in range(tree.size)), max(0, state.remaining - 1)
    if depth > room:
        raise DraftOverrunError(
            f"a tree {depth} nodes deep received; the session may emit {state.remaining} more "
            f"tokens, so at most {room} deep"
        )
    replay_tree(state.mt, tree, state.params.greedy)
