"""Sending on the decision (lane.send_on_decision; proposer_mac.driver's module note): round
r + 1's request built on the head round r's signed result will carry if it says what r's
early decision said, journaled (PREPARED r + 1 before COMMITTED r) and sent before that
result; then, once the result is in, whether the request ahead held or is void.

`SendAhead` is handed the session's `DraftingAhead` (the draft it sends) and, per result,
the commit to make durable when the request ahead held, so it needs nothing of the driver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from muser.records import Signed
from muser.round import clip_emission
from muser.stats import LaneStats
from muser.wire import muser_v2_pb2 as pb
from proposer_mac import journal
from proposer_mac.ahead import DraftingAhead, Taken, look_ahead
from proposer_mac.context import DriverContext
from proposer_mac.link import LinkDown, RoundRefused, RoundStream
from proposer_mac.session import Outcome, ProposerSession
from proposer_mac.speculating import Speculating

log = logging.getLogger("muser.proposer")


@dataclass(frozen=True)
class Ahead:
    """Round r + 1's request, journaled on round r's early decision (`send`)."""

    signed: Signed
    taken: Taken
    stream: RoundStream | None
    """The stream it went out on (None: journaled, not sent)."""
    sent: pb.RoundRequest | None
    speculation: Speculating | None
    """The round after it, drafting ahead since it was sent."""


class SendAhead:
    """One session's request ahead: at most one at a time (`sending`)."""

    def __init__(
        self,
        session: ProposerSession,
        core: DriverContext,
        stats: LaneStats,
        ahead: DraftingAhead,
    ) -> None:
        self.session, self.core, self.stats, self.ahead = session, core, stats, ahead
        self.sending: asyncio.Future | None = None
        """Round r + 1 going out on round r's early decision (`send`)."""

    def start(self, stream: RoundStream, speculation: Speculating, outcome: Outcome) -> None:
        """Send the next request ahead on `outcome` (the decision's), beside the caller."""
        self.sending = asyncio.ensure_future(self.send(stream, speculation, outcome))

    async def send(
        self, stream: RoundStream, speculation: Speculating, outcome: Outcome
    ) -> Ahead | None:
        """Round r's early decision is in: once the next draft on that outcome is ready,
        build round r + 1's request on the head r's result will carry if it says the same
        (`ProposerSession.predict`), journal its PREPARED and send it, before r's signed
        result (lane.send_on_decision). The verifier takes it after r; a result that
        says otherwise voids it (the verifier refuses its head, nothing written) and the
        driver drafts r + 1 again. None when nothing went ahead."""
        s = self.session
        if not speculation.drafts_on(outcome.emitted):
            return None
        max_tokens, stops = s.params.max_tokens, s.params.stop_tokens
        clip = clip_emission(outcome.emitted, outcome.produced, max_tokens, stops)
        if clip.done:
            return None
        taken = await self.ahead.take(speculation, outcome.emitted, None, miss=False)
        if taken is None:
            return None
        proposal = taken.proposal
        remaining = max_tokens - outcome.produced - len(clip.tokens)
        decode_len = 1 if proposal.drafts else s.width.decode_len(remaining)
        signed = s.build_request(
            proposal.drafts, proposal.q_rows, self.core.private, decode_len,
            parents=proposal.parents, after=outcome,
        )  # fmt: skip
        await self.core.log.append_async(
            journal.encode_prepared(s.session_id, outcome.round + 1, signed)
        )
        s.ahead = signed
        try:
            sent = await stream.send(signed)
        except (LinkDown, RoundRefused):
            sent = None  # sent again on the stream the driver goes on with
        self.stats.sent_ahead += 1
        # the round after it is drafted ahead from here, as after any send: on the
        # transcript this decision leaves, while r's result is checked and committed
        after = (outcome.transcript, outcome.produced + len(clip.tokens), outcome.state)
        speculation = self.ahead.start(proposal, after)
        if speculation is not None and self.core.lookahead:
            look_ahead(stream, speculation, outcome.round + 2)
        return Ahead(signed, taken, stream if sent is not None else None, sent, speculation)

    async def in_flight(
        self, signed: Signed, commit: Callable[[], Awaitable[None]], stream: RoundStream | None
    ) -> tuple[Literal["none", "held", "void"], Ahead | None]:
        """After a round's result (`signed`) is checked and applied: did the next request go
        ahead, on its decision (`send`, whose return comes second) or before a restart?
        "held": it expects the head the result carries, so the round's COMMITTED is made
        durable here (`commit`) and that request is in flight. "void": it expects another head; the stream
        that carries its refusal is closed. "none": nothing went ahead."""
        s = self.session
        try:  # a failed draft fails the session: `_fail` makes this round durable
            went = await self.sending if self.sending is not None else None
        finally:
            self.sending = None
        if s.ahead is None:
            return "none", went
        ahead, s.ahead = s.ahead, None
        if journal.next_in_flight(ahead, signed) is not None:  # as replay decides it
            await commit()  # its PREPARED is durable already
            s.prepared = ahead
            if went is not None:
                self.ahead.hit(went.taken)
            return "held", went
        # the signed result is not what its decision said: that request is void (its head is
        # not the verifier's) and the stream carries its refusal
        log.warning(
            "session %s round %d: the result differs from its early decision; round %d is "
            "drafted again", s.session_id.hex()[:8], s.next_round - 1, s.next_round,
        )  # fmt: skip
        self.stats.ahead_void += 1
        if stream is not None:
            stream.close()
        if went is not None and went.speculation is not None:
            went.speculation.drop()  # drafted on the void request
        return "void", went
