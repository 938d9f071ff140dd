"""The proposer's gRPC service (muser.v2.Proposer): client-facing Generate and Status, and
the view of its stats that metrics and Status export (`metrics_view`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from muser import faults
from muser.affinity import pinned_to
from muser.errors import MuserError, RefusedError
from muser.metrics import DaemonView, status_fields
from muser.stats import LaneStats
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from proposer_mac.link import RoundRefused

if TYPE_CHECKING:
    from proposer_mac.core import ProposerCore


def refusal_reason(exc: MuserError) -> str:
    """The `reason` label of a Generate refusal: the verifier's when it refused the open."""
    if isinstance(exc, RoundRefused):
        return f"verifier_{exc.reason}"
    return "refused" if isinstance(exc, RefusedError) else "internal"


def metrics_view(core: ProposerCore) -> DaemonView:
    """The proposer's stats as `muser.metrics` exports them: its sessions' rounds summed."""
    runners = list(core.runners.values())
    return DaemonView(
        role="proposer",
        key_id=core.key_id,
        lane=LaneStats.total([core.retired, *(r.stats for r in runners)]),
        daemon=core.stats,
        sessions=len(runners),
        open_sessions=sum(1 for r in runners if not r.session.done),
        wal_dir=core.log.directory,
        now=core.stats.clock(),
        drafting=core.context.drafts.stats,
        placement=placement(core),
        fences=core.pool.fences,
        fragment_bytes=core.pool.fragment_bytes,
    )


def placement(core: ProposerCore) -> dict[str, int]:
    """Unfinished sessions by the pool verifier they live on (every verifier listed)."""
    out = dict.fromkeys(core.pool.order, 0)
    for r in core.runners.values():
        if not r.session.done and r.error is None:
            home = r.session.home or core.pool.order[0]
            out[home] = out.get(home, 0) + 1
    return out


def sessions_table(core: ProposerCore, limit: int = 100) -> list[dict]:
    """Where each unfinished session lives, at which epoch, and how often it moved (the
    `limit` most recently opened)."""
    rows = [
        {
            "session": r.session.session_id.hex(),
            "verifier": r.session.home or core.pool.order[0],
            "epoch": r.session.epoch,
            "moves": r.session.moves,
            "tokens": len(r.session.emitted),
        }
        for r in core.runners.values()
        if not r.session.done and r.error is None
    ]
    return rows[-limit:]


FINAL = (("muser-answer", "final"),)
"""Trailing metadata of every refusal or failure Generate answers itself: the client takes
it as the answer, not as a broken stream to reconnect (whatever its status code)."""


class ProposerServicer(pb_grpc.ProposerServicer):
    def __init__(self, core: ProposerCore):
        self.core = core

    async def Generate(self, request: pb.GenerateRequest, context):
        core = self.core
        try:
            if request.session_id:
                runner = core.runners.get(bytes(request.session_id))
                if runner is None:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"unknown session {bytes(request.session_id).hex()} (a proposer "
                        "keeps the last limits.finished_sessions finished sessions)",
                        trailing_metadata=FINAL,
                    )
            else:
                runner = await core.new_session(request)
                # the session is journaled: its id goes out at once, with no tokens, so a
                # client whose proposer dies before the first round can still reconnect
                yield pb.GenerateEvent(
                    session_id=runner.session.session_id,
                    offset=0,
                    prompt_tokens=len(runner.session.prompt),
                )
        except MuserError as exc:
            code = getattr(exc, "code", None)
            if not isinstance(code, grpc.StatusCode):
                code = (
                    grpc.StatusCode.INVALID_ARGUMENT
                    if isinstance(exc, RefusedError)
                    else grpc.StatusCode.INTERNAL
                )
            core.stats.observe_refusal(refusal_reason(exc), code.name)
            await context.abort(code, str(exc), trailing_metadata=FINAL)
        session = runner.session
        offset = request.offset
        if offset > len(session.emitted) and session.done:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"offset {offset} beyond the {len(session.emitted)} tokens emitted",
                trailing_metadata=FINAL,
            )
        sent = core.tokenizer.decode(session.emitted[:offset])  # the text before this stream
        while True:
            try:
                tokens, done = await runner.wait_tokens(offset)
            except MuserError as exc:
                code = getattr(exc, "code", grpc.StatusCode.INTERNAL)
                await context.abort(code, str(exc), trailing_metadata=FINAL)
            # an event's text = text(tokens through it) minus text(tokens before it): what a
            # client reconnecting at any offset also gets; one decode per event
            whole = core.tokenizer.decode(session.emitted[: offset + len(tokens)])
            text, sent = whole[len(sent) :], whole
            event = pb.GenerateEvent(
                session_id=session.session_id,
                offset=offset,
                tokens=tokens,
                text=text,
                done=done,
                prompt_tokens=len(session.prompt),
            )
            if done:
                event.stats_json = json.dumps(runner.stats.to_dict())
            yield event
            if tokens:
                faults.reached("proposer.after_emit")
            offset += len(tokens)
            if done:
                return

    async def Status(self, request, context):
        core = self.core
        view = metrics_view(core)
        body = {
            "role": "proposer",
            "key_id": core.key_id,
            **status_fields(view),
            "active": sum(1 for r in core.runners.values() if not r.session.done),
            # "mlx:gpu", "mlx:cpu", "torch:cpu": where the draft runs, as loaded (never assumed)
            "draft_device": getattr(core.draft, "device_label", "unknown"),
            # torch: "lean" or "transformers" (the backend's forward); absent for mlx
            "draft_forward": getattr(core.draft, "forward_kind", None),
            "cpus": pinned_to(),  # the CPUs proposer.cpus (or a cpuset) confines it to
            # rounds of concurrent sessions drafted together (lane.draft_batch): size -> batches
            "drafting": {
                "batch": core.draft_batch,
                "batch_sizes": core.context.drafts.stats.to_dict(),
                "waiting": core.context.drafts.waiting,
            },
            "verifier": core.config.verifier.address,
            # where sessions live (proposer_mac.pool): each verifier, moves, fences, sessions
            "pool": {
                "verifiers": [
                    {"name": m.name, "address": m.address, "key_id": m.key_id}
                    for m in core.pool.members.values()
                ],
                "current": core.pool.current,
                "placement": placement(core),
                "moves": view.lane.moves,
                "fences": core.pool.fences,
                "fragment_bytes_sent": core.pool.fragment_bytes,
                "sessions": sessions_table(core),
            },
        }
        return pb.StatusResponse(
            role="proposer", key_id=core.key_id, sessions=len(core.runners), json=json.dumps(body)
        )
