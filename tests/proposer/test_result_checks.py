"""Forgery: a result altered in any field, or signed by an unenrolled key, is refused."""

from __future__ import annotations

import dataclasses

import pytest

from muser import keys
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
from muser.sampling import SamplingParams, target_probs
from muser.verify import judge_round
from proposer_mac.drafting import Drafter
from proposer_mac.session import ProposerSession, ResultRejected
from tests.core.fake_backend import FakeBackend

IDENT = Identity("target-digest", "tok-digest", 24)


def honest_round(session: ProposerSession, proposer_key, verifier_key, depth=3):
    """One round as an honest verifier would answer it (same maths as the daemon)."""
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
    result = dataclasses.replace(unsigned, head=unsigned.expected_head())
    body = result.encode()
    return signed_req, Signed(body, verifier_key.sign(body)), result


@pytest.fixture
def setup():
    proposer_key, verifier_key = keys.generate(), keys.generate()
    params = SamplingParams(temperature=1.0, max_tokens=32, seed=9)
    session = ProposerSession.create(
        [1, 2, 3, 4], params, IDENT, IDENT, keys.key_id(proposer_key.public_key()), 3
    )
    enrolled = {keys.key_id(verifier_key.public_key()): verifier_key.public_key()}
    return session, proposer_key, verifier_key, enrolled


def test_an_honest_result_is_accepted_and_applied(setup):
    session, proposer_key, verifier_key, enrolled = setup
    signed_req, signed, result = honest_round(session, proposer_key, verifier_key)
    checked = session.check_result(signed_req, signed, enrolled)
    assert checked == result
    tokens = session.apply(checked)
    assert tokens == result.emitted()
    assert session.head == result.head and session.next_round == 1


FIELDS = [f.name for f in dataclasses.fields(RoundResult) if f.name != "verifier_key_id"]


def _altered(value, field: str):
    if field == "decoded":  # empty in a round with drafts: any token there is a forgery
        return (*value, 1)
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
    forged = dataclasses.replace(result, **{field: _altered(getattr(result, field), field)})
    # re-signed by the real verifier key: the content checks alone must refuse it
    resigned = Signed(forged.encode(), verifier_key.sign(forged.encode()))
    with pytest.raises(ResultRejected):
        session.check_result(signed_req, resigned, enrolled)
    # kept with the original signature: the signature check refuses it
    with pytest.raises(ResultRejected, match="signature"):
        session.check_result(signed_req, Signed(forged.encode(), signed.signature), enrolled)
    assert session.next_round == 0 and session.emitted == []


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
