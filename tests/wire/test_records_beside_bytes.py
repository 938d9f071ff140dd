"""A signed record keeps the record it was encoded from (`Signed.record`), so the round's
readers do not decode what was just encoded; bytes received from elsewhere are decoded."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from muser.records import RoundRequest, RoundResult, Signed, request_of, result_of
from muser.sampling import SparseRow
from muser.wire import convert

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


def request() -> RoundRequest:
    rows = tuple(
        SparseRow(np.array([1, 5, 9 + i]), np.array([0.25, 0.5, 0.125 * (i + 1)])) for i in range(3)
    )
    return RoundRequest(
        b"s" * 16, 7, 2, b"h" * 32, 11, (5, 9, 10), rows, b"m" * 32, (b"t" * 32,), "kid", 1
    )


def result() -> RoundResult:
    return RoundResult(
        b"s" * 16, 7, 2, b"h" * 32, b"r" * 32, 11, (5, 9, 10), 2, 4, b"p" * 32, b"x" * 32,
        (), b"n" * 32, "vk", (),
    )  # fmt: skip


def same_request(a: RoundRequest, b: RoundRequest) -> None:
    assert a.encode() == b.encode()
    for qa, qb in zip(a.q_rows, b.q_rows, strict=True):
        assert qa.ids.tolist() == qb.ids.tolist() and qa.weights.tolist() == qb.weights.tolist()


def test_a_signed_request_keeps_its_record_and_received_bytes_are_decoded():
    r = request()
    signed = Signed.of(r, KEY.sign)
    assert signed.body == r.encode() and signed.record is r
    KEY.public_key().verify(signed.signature, signed.body)
    assert request_of(signed) is r
    received = Signed.decode(signed.encode())
    assert received.record is None and received == signed  # the record is not compared
    same_request(request_of(received), r)


def test_a_request_through_protobuf_is_the_record_its_body_encodes():
    signed = Signed.of(request(), KEY.sign)
    back = convert.request_from_pb(convert.request_to_pb(signed))
    assert back == signed and back.record is not None
    assert back.record.encode() == back.body
    same_request(request_of(back), RoundRequest.decode(back.body))


def test_a_result_through_protobuf_is_the_record_its_body_encodes():
    r = result()
    signed = Signed.of(r, KEY.sign)
    assert result_of(signed) is r
    back = convert.result_from_pb(convert.result_to_pb(signed))
    assert back == signed and back.record.encode() == back.body
    assert result_of(Signed.decode(back.encode())) == r  # decoded: equal, not the same object


def test_a_lookup_round_is_its_own_domain_and_crosses_the_wire():
    """A decode round with a lookup rule encodes under its own domain (a chain reader refuses
    it; a round without the rule keeps its bytes), crosses the wire whole, and a rule that
    is not (min_n, max_n), or rides on a tree, is refused before it is signed or read."""
    import dataclasses

    import pytest

    from muser.canonical import CanonicalError, Reader

    plain = dataclasses.replace(request(), drafts=(), q_rows=(), decode_len=8)
    looked = dataclasses.replace(plain, lookup=(2, 3))
    assert RoundRequest.decode(looked.encode()) == looked
    assert looked.encode() != plain.encode() and RoundRequest.decode(plain.encode()).lookup == ()
    with pytest.raises(CanonicalError):
        Reader(looked.encode(), "round-request")
    back = request_of(convert.request_from_pb(convert.request_to_pb(Signed.of(looked, KEY.sign))))
    assert back.lookup == (2, 3) and back.encode() == looked.encode()
    message = convert.request_to_pb(Signed.of(looked, KEY.sign))
    del message.lookup[1]
    with pytest.raises(
        CanonicalError, match=r"names \(min_n, max_n\) and no tree; got lookup \[2\]"
    ):
        convert.request_from_pb(message)
    with pytest.raises(CanonicalError, match="with 1 tree nodes"):
        dataclasses.replace(
            looked, parents=(-1,), drafts=(5,), q_rows=request().q_rows[:1]
        ).encode()


def test_logprobs_ride_in_the_signed_result_not_the_round_record():
    """A result carrying logprobs encodes under its own domain (a plain result reader refuses
    it), crosses the wire whole, keeps the round record and so the head of the same result
    without them, and a count that is not one per emitted token is refused on both sides."""
    import dataclasses

    import pytest

    from muser.canonical import CanonicalError, Reader
    from muser.logprobs import TokenLogprobs

    plain = result()  # emits drafts 5, 9 and the next frontier 4
    lps = tuple(TokenLogprobs(-0.5 * i, (4, 5), (-0.1, -2.5)) for i in range(3))
    with_lps = dataclasses.replace(plain, logprobs=lps)
    assert RoundResult.decode(with_lps.encode()) == with_lps
    assert with_lps.record_bytes() == plain.record_bytes()
    assert with_lps.expected_head() == plain.expected_head()
    assert with_lps.encode() != plain.encode()
    with pytest.raises(CanonicalError):
        Reader(with_lps.encode(), "round-result")
    back = convert.result_from_pb(convert.result_to_pb(Signed.of(with_lps, KEY.sign)))
    assert result_of(back).logprobs == lps and back.body == with_lps.encode()
    with pytest.raises(CanonicalError, match="emitting 3 tokens carries 2 logprobs"):
        dataclasses.replace(plain, logprobs=lps[:2]).encode()
    message = convert.result_to_pb(Signed.of(with_lps, KEY.sign))
    del message.logprobs[0]
    with pytest.raises(CanonicalError, match="carries 2 logprobs"):
        convert.result_from_pb(message)
    truncated = with_lps.encode()[:-8]
    with pytest.raises(CanonicalError):
        RoundResult.decode(truncated)


def test_a_session_asking_for_logprobs_opens_under_its_own_domain():
    import dataclasses

    from muser.records import Identity, SessionOpen
    from muser.sampling import SamplingParams

    ident = Identity("m", "t", 24)
    plain = SessionOpen(b"s" * 16, ident, ident, SamplingParams(seed=3), b"p" * 32, "pk")
    asking = dataclasses.replace(plain, params=SamplingParams(seed=3, logprobs=5))
    assert SessionOpen.decode(asking.encode()) == asking
    assert SessionOpen.decode(plain.encode()).params.logprobs is None
    assert asking.genesis_head() != plain.genesis_head()
    params = convert.params_from_pb(convert.params_to_pb(asking.params))
    assert params.logprobs == 5
    assert convert.params_from_pb(convert.params_to_pb(plain.params)).logprobs is None
    zero = convert.params_to_pb(SamplingParams(logprobs=0))
    assert convert.params_from_pb(zero).logprobs == 0  # 0 alternatives is not none
