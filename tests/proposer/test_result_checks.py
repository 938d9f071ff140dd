"""Forgery: a result altered in any field, or signed by an unenrolled key, is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from muser import keys
from muser.logprobs import TokenLogprobs, log_softmax64, token_logprobs
from muser.mt19937 import Mt19937
from muser.records import (
    Identity,
    RoundRequest,
    RoundResult,
    Signed,
    advance,
    draws_for_round,
    sha256,
    state_digest,
    transcript_digest,
)
from muser.sampling import SamplingParams, draft_row, target_probs
from muser.tree import draft_tree, judge_tree, per_path
from muser.tree_width import full_parents
from muser.verify import judge_round
from proposer_mac.drafting import Drafter
from proposer_mac.session import ProposerSession, ResultRejected
from tests.core.fake_backend import FakeBackend

IDENT = Identity("target-digest", "tok-digest", 24)


def honest_round(session: ProposerSession, proposer_key, verifier_key, depth=3):
    """One round as an honest verifier would answer it (same maths as the daemon), with the
    emitted tokens' logprobs when the session asked for them."""
    drafter = Drafter(FakeBackend(order=1, salt=1), session.params, q_top_k=8)
    proposal = drafter.draft(session.transcript, session.state, depth)
    signed_req = session.build_request(proposal.drafts, proposal.q_rows, proposer_key)
    target = FakeBackend()
    logits = target.evaluate(session.transcript + proposal.drafts)[len(session.transcript) - 1 :]
    decision = judge_round(
        session.state,
        session.transcript[-1],
        proposal.drafts,
        proposal.q_rows,
        target_probs(logits, session.params),
        greedy=session.params.greedy,
    )
    emitted = decision.emitted(proposal.drafts)
    post = advance(session.state, draws_for_round(depth, decision.accepted, session.params.greedy))
    assert post == decision.post_state
    unsigned = RoundResult(
        session.session_id,
        session.next_round,
        session.epoch,
        session.head,
        sha256(signed_req.body),
        session.transcript[-1],
        tuple(proposal.drafts),
        decision.accepted,
        decision.next_frontier,
        state_digest(post),
        transcript_digest(session.transcript + emitted),
        (),
        b"\0" * 32,
        keys.key_id(verifier_key.public_key()),
    )
    k = session.params.logprobs
    if k is not None:
        lps = token_logprobs(logits[: decision.accepted + 1], emitted, k)
        unsigned = dataclasses.replace(unsigned, logprobs=lps)
    result = dataclasses.replace(unsigned, head=unsigned.expected_head())
    body = result.encode()
    return signed_req, Signed(body, verifier_key.sign(body)), result


def _setup(**params):
    """A fresh session (T = 1 unless `params` say otherwise), its keys, the enrolled keys."""
    proposer_key, verifier_key = keys.generate(), keys.generate()
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 32, "seed": 9, **params})
    session = ProposerSession.create(
        [1, 2, 3, 4], params, IDENT, IDENT, keys.key_id(proposer_key.public_key()), 3
    )
    enrolled = {keys.key_id(verifier_key.public_key()): verifier_key.public_key()}
    return session, proposer_key, verifier_key, enrolled


@pytest.fixture
def setup():
    return _setup()


def test_an_honest_result_is_accepted_and_applied(setup):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, signed, result = honest_round(session, proposer_key, verifier_key)
    checked = session.check_result(signed_req, signed, enrolled)
    assert checked == result
    tokens = session.apply(checked)
    assert tokens == result.emitted()
    assert session.head == result.head and session.next_round == 1


FIELDS = [
    f.name for f in dataclasses.fields(RoundResult) if f.name not in ("verifier_key_id", "path")
]
"""(A chain's canonical bytes carry no path: tree results' forgeries are below.)"""


def _altered(value, field: str):
    if field == "decoded":  # empty in a round with drafts: any token there is a forgery
        return (*value, 1)
    if field == "parents":  # a chain's result names no topology
        return (*value, -1)
    if isinstance(value, bytes):
        return bytes([value[0] ^ 1]) + value[1:] if value else b"\x01"
    if isinstance(value, int):
        return value + 1
    if isinstance(value, tuple):
        return (*value, b"\x01" * 32) if not value or isinstance(value[0], bytes) else (*value, 1)
    raise TypeError(value)


@pytest.mark.parametrize("field", FIELDS)
def test_a_result_altered_in_any_field_is_refused(setup, field):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, signed, result = honest_round(session, proposer_key, verifier_key)
    if field == "logprobs":  # a session that asked for none: any logprobs are a forgery
        altered = tuple(TokenLogprobs(-0.5, (), ()) for _ in result.emitted())
    else:
        altered = _altered(getattr(result, field), field)
    forged = dataclasses.replace(result, **{field: altered})
    # re-signed by the real verifier key: the content checks alone must refuse it
    resigned = Signed(forged.encode(), verifier_key.sign(forged.encode()))
    with pytest.raises(ResultRejected):
        session.check_result(signed_req, resigned, enrolled)
    # kept with the original signature: the signature check refuses it
    with pytest.raises(ResultRejected, match="signature"):
        session.check_result(signed_req, Signed(forged.encode(), signed.signature), enrolled)
    assert session.next_round == 0 and session.emitted == []


@pytest.fixture
def logprob_setup():
    return _setup(logprobs=3)


def test_a_session_asking_for_logprobs_keeps_the_targets_beside_its_tokens(logprob_setup):
    session, proposer_key, verifier_key, enrolled = logprob_setup
    signed_req, signed, result = honest_round(session, proposer_key, verifier_key)
    assert len(result.logprobs) == len(result.emitted()) > 0
    tokens = session.apply(session.check_result(signed_req, signed, enrolled))
    assert session.logprobs == list(result.logprobs[: len(tokens)])
    request = RoundRequest.decode(signed_req.body)
    rows = FakeBackend().evaluate([1, 2, 3, 4, *request.drafts])[3:]
    for i, (token, lp) in enumerate(zip(tokens, session.logprobs, strict=True)):
        row = log_softmax64(rows[i])  # the target's row at the token's position
        assert lp.logprob == row[token]
        assert list(lp.top_ids) == sorted(range(24), key=lambda t: (-row[t], t))[:3]


def _forge_logprobs(result, how):
    lps = list(result.logprobs)
    first = lps[0]
    if how == "too few alternatives":
        lps[0] = TokenLogprobs(first.logprob, first.top_ids[:2], first.top_logprobs[:2])
    elif how == "an id outside the vocabulary":
        lps[0] = TokenLogprobs(first.logprob, (*first.top_ids[:2], 24), first.top_logprobs)
    elif how == "a repeated id":
        ids = (first.top_ids[0],) * 3
        lps[0] = TokenLogprobs(first.logprob, ids, first.top_logprobs)
    elif how == "a positive log-probability":
        lps[0] = TokenLogprobs(0.25, first.top_ids, first.top_logprobs)
    elif how == "not a number":
        lps[0] = TokenLogprobs(first.logprob, first.top_ids, (float("nan"),) * 3)
    return dataclasses.replace(result, logprobs=tuple(lps))


@pytest.mark.parametrize(
    "how",
    [
        "too few alternatives",
        "an id outside the vocabulary",
        "a repeated id",
        "a positive log-probability",
        "not a number",
    ],
)
def test_logprobs_of_the_wrong_shape_are_refused(logprob_setup, how):
    session, proposer_key, verifier_key, enrolled = logprob_setup
    signed_req, _, result = honest_round(session, proposer_key, verifier_key)
    body = _forge_logprobs(result, how).encode()
    with pytest.raises(ResultRejected, match="logprobs"):
        session.check_result(signed_req, Signed(body, verifier_key.sign(body)), enrolled)
    assert session.next_round == 0 and session.logprobs == []


def test_a_result_signed_by_an_unenrolled_key_is_refused(setup):
    session, proposer_key, _, enrolled = setup
    rogue = keys.generate()
    signed_req, signed, _ = honest_round(session, proposer_key, rogue)
    with pytest.raises(ResultRejected, match="not an enrolled verifier"):
        session.check_result(signed_req, signed, enrolled)


def test_a_result_claiming_the_enrolled_key_id_but_signed_by_another_is_refused(setup):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, _, result = honest_round(session, proposer_key, verifier_key)
    rogue = keys.generate()
    with pytest.raises(ResultRejected, match="signature does not verify"):
        session.check_result(
            signed_req, Signed(result.encode(), rogue.sign(result.encode())), enrolled
        )


def test_garbage_bytes_are_refused_not_crashed_on(setup):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, _, _ = honest_round(session, proposer_key, verifier_key)
    with pytest.raises(ResultRejected, match="not a canonical round result"):
        session.check_result(signed_req, Signed(b"nonsense", b"sig"), enrolled)


def test_request_round_trips_through_canonical_bytes(setup):
    session, proposer_key, verifier_key, _ = setup
    signed_req, _, _ = honest_round(session, proposer_key, verifier_key)
    request = RoundRequest.decode(signed_req.body)
    assert request.encode() == signed_req.body
    keys.verify(proposer_key.public_key(), signed_req.body, signed_req.signature, "request")


def test_a_result_signed_by_another_enrolled_verifier_than_the_one_that_opened_is_refused(
    setup,
):
    """A pool enrols several verifiers; a session takes results only from the one that
    answered its open (`signer`): no round is taken from two verifiers."""
    session, proposer_key, verifier_key, enrolled = setup
    other = keys.generate()
    enrolled = {**enrolled, keys.key_id(other.public_key()): other.public_key()}
    session.signer = keys.key_id(verifier_key.public_key())
    signed_req, _, _ = honest_round(session, proposer_key, other)
    _, from_other, _ = honest_round(session, proposer_key, other)
    with pytest.raises(ResultRejected, match="the session lives on the verifier with key"):
        session.check_result(signed_req, from_other, enrolled)
    session.signer = keys.key_id(other.public_key())  # it moved there: now that one's
    session.check_result(signed_req, from_other, enrolled)


def test_a_move_signs_the_request_in_flight_again_at_the_new_epoch_only(setup):
    """A move re-signs the request in flight at the next epoch: every other field the
    same; a result at the old epoch then does not check."""
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, signed, _ = honest_round(session, proposer_key, verifier_key)
    session.place("b", 2)
    again = session.resign(signed_req, proposer_key)
    old, new = RoundRequest.decode(signed_req.body), RoundRequest.decode(again.body)
    assert new.encode() == dataclasses.replace(old, epoch=2).encode() and old.epoch == 1
    keys.verify(proposer_key.public_key(), again.body, again.signature, "request")
    assert (session.home, session.homes, session.moves, session.signer) == ("b", ["b"], 0, None)
    with pytest.raises(ResultRejected, match="result epoch is 1, expected 2"):
        session.check_result(again, signed, enrolled)


def honest_tree_round(session: ProposerSession, proposer_key, verifier_key, branching=(2, 2)):
    """One tree round (docs/design.md §3) as an honest verifier answers it: the fake draft's
    rows and the fake target's at every position of the tree, judged by `judge_tree`."""
    params, transcript = session.params, list(session.transcript)

    def last_row(backend, path):
        return backend.evaluate([*transcript, *path])[-1]

    rows = per_path(lambda path: draft_row(last_row(FakeBackend(order=1, salt=1), path), params, 8))
    tree = draft_tree(session.state.copy(), full_parents(branching), rows, params.greedy)
    signed_req = session.build_request(
        list(tree.tokens), list(tree.wire_rows()), proposer_key, parents=tree.parents
    )
    ends = [[]] + [[tree.tokens[i] for i in tree.path(n)] for n in range(tree.size)]
    witness = target_probs(np.stack([last_row(FakeBackend(), e) for e in ends]), params)
    decision = judge_tree(session.state, transcript[-1], tree, witness, greedy=params.greedy,
                          max_nodes=64)  # fmt: skip
    unsigned = RoundResult(
        session.session_id, session.next_round, session.epoch, session.head,
        sha256(signed_req.body), transcript[-1], tree.tokens, decision.accepted,
        decision.next_frontier, state_digest(decision.post_state),
        transcript_digest(transcript + decision.emitted(tree)), (), b"\0" * 32,
        keys.key_id(verifier_key.public_key()), (), tree.parents, decision.path,
    )  # fmt: skip
    result = dataclasses.replace(unsigned, head=unsigned.expected_head())
    return signed_req, Signed(result.encode(), verifier_key.sign(result.encode())), result


def test_an_honest_tree_result_is_accepted_and_applied(setup):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, signed, result = honest_tree_round(session, proposer_key, verifier_key)
    assert result.is_tree and len(result.drafts) == 6
    checked = session.check_result(signed_req, signed, enrolled)
    assert session.apply(checked) == result.emitted()
    assert session.state == advance(Mt19937.from_seed(9), result.draws(False))


def _other_path(result: RoundResult) -> tuple[int, ...]:
    """A path of the same topology that is not the accepted one."""
    options = [(), *((i,) for i, p in enumerate(result.parents) if p == -1)]
    return next(p for p in options if p != result.path)


TREE_FORGERIES = {
    "another_path": lambda r: dataclasses.replace(r, path=_other_path(r),
                                                  accepted=len(_other_path(r))),
    "not_a_path": lambda r: dataclasses.replace(r, path=(len(r.drafts) - 1,), accepted=1),
    "accepted_not_the_paths_length": lambda r: dataclasses.replace(r, accepted=r.accepted + 1),
    "another_topology": lambda r: dataclasses.replace(r, parents=(-1,) * len(r.parents)),
    "read_as_a_chain": lambda r: dataclasses.replace(r, parents=(), path=()),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TREE_FORGERIES))
def test_a_forged_tree_result_is_refused(setup, case):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, _, result = honest_tree_round(session, proposer_key, verifier_key)
    forged = TREE_FORGERIES[case](result)
    forged = dataclasses.replace(forged, head=forged.expected_head())  # a consistent chain
    resigned = Signed(forged.encode(), verifier_key.sign(forged.encode()))
    with pytest.raises(ResultRejected):
        session.check_result(signed_req, resigned, enrolled)
    assert session.next_round == 0 and session.emitted == []


@pytest.mark.parametrize(
    ("layers", "features", "decode_len"),
    [
        ((0,), ["capture-decode"], 8),
        ((0,), [], 1),  # a verifier from before capture-decode refuses more than one
        ((), [], 8),  # a session that captures nothing decodes the lane's decode_len anyway
    ],
)
def test_a_capturing_session_decodes_what_its_verifier_offers(layers, features, decode_len):
    from muser.width import FixedWidth
    from proposer_mac.context import fit_decode

    session = ProposerSession.create(
        [1, 2, 3], SamplingParams(max_tokens=32), IDENT, IDENT, "key", 0, layers,
        width=FixedWidth(0, 8),
    )  # fmt: skip
    fit_decode(session, features)
    assert session.width.decode_len(32) == decode_len


def decode_result(session, signed_req, tokens, verifier_key) -> Signed:
    """The signed result of a decode round that emitted `tokens` (one draw each, sampled)."""
    post = advance(session.state, 0 if session.params.greedy else len(tokens))
    unsigned = RoundResult(
        session.session_id, session.next_round, session.epoch, session.head,
        sha256(signed_req.body), session.transcript[-1], (), 0, tokens[-1], state_digest(post),
        transcript_digest(session.transcript + tokens), (), b"\0" * 32,
        keys.key_id(verifier_key.public_key()), tuple(tokens[:-1]),
    )  # fmt: skip
    result = dataclasses.replace(unsigned, head=unsigned.expected_head())
    return Signed(result.encode(), verifier_key.sign(result.encode()))


@pytest.mark.parametrize("features", [["lookup-stop"], []])
def test_a_lookup_round_is_held_to_its_first_match(setup, features):
    """An n-gram session's decode rounds carry its lookup rule on a verifier that offers
    `lookup-stop` (none else) while its width drafts (D > 0: at D = 0 no round would draft
    the match); the result must end after its first token the lookup extends: one that runs
    past that match, or stops short of any, is refused."""
    from muser.lookup import PromptLookup
    from muser.width import FixedWidth
    from proposer_mac.context import fit_decode
    from tests.verifier.test_decode_batch import lookup_cut
    from verifier_gx.decode import decode_round
    from verifier_gx.executor import TargetExecutor

    session, proposer_key, verifier_key, enrolled = setup
    session.width, session.lookup = FixedWidth(0, 8), (2, 3)
    session.transcript = [1, 2, 3, 4, 1, 2, 5, 6, 7, 5]
    fit_decode(session, features)
    undrafting = session.build_request([], [], proposer_key, 8)
    assert RoundRequest.decode(undrafting.body).lookup == ()  # D = 0: no round drafts a match
    session.width = FixedWidth(3, 8)
    signed_req = session.build_request([], [], proposer_key, 8)  # the lookup declined
    request = RoundRequest.decode(signed_req.body)
    assert request.lookup == ((2, 3) if features else ())
    drafted = session.build_request(*honest_parts(session), proposer_key)
    assert RoundRequest.decode(drafted.body).lookup == ()  # a round with drafts: never
    full = decode_round(TargetExecutor(FakeBackend()), session.transcript, session.state, 8,
                        session.params).tokens  # fmt: skip
    n = lookup_cut(session.transcript, full, (2, 3))
    assert 1 < n < 8  # this transcript's decode meets a match after a few tokens
    honest = full[:n] if features else full
    for tokens in (full, full[: n - 1], honest):
        result = decode_result(session, signed_req, tokens, verifier_key)
        if tokens is honest:
            assert session.check_result(signed_req, result, enrolled).emitted() == honest
        else:
            with pytest.raises(ResultRejected, match="decode round asked for 8 tokens"):
                session.check_result(signed_req, result, enrolled)
    assert PromptLookup(2, 3, [*session.transcript, *full[:n]]).proposal() is not None


def honest_parts(session):
    """A chain draft's (drafts, q_rows) for the session's next round."""
    proposal = Drafter(FakeBackend(order=1, salt=1), session.params, q_top_k=8).draft(
        session.transcript, session.state, 2
    )
    return proposal.drafts, proposal.q_rows
