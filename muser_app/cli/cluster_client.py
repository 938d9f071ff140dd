"""The client side of `muser generate --lane cluster`: stream from the proposer daemon.

If the stream breaks (proposer restart, cut connection) the client reconnects with its
session id and the number of tokens it holds, with backoff, and receives the rest of the
stream: no gap, no repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from muser.channels import KeepaliveLimits
from muser.errors import MuserError, RefusedError
from muser.sampling import SamplingParams


class ClusterClientError(MuserError):
    """The proposer failed the request or stayed unreachable (exit 3)."""


class ClusterRefusedError(ClusterClientError, RefusedError):
    """The proposer refused what was asked: bad input, or a cluster configured so that it
    cannot serve it (exit 2: the message says what to change)."""


REFUSALS = frozenset(
    {
        "INVALID_ARGUMENT",
        "OUT_OF_RANGE",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "RESOURCE_EXHAUSTED",
        "ALREADY_EXISTS",
    }
)
"""The status codes a daemon refuses with (verifier_gx.servicer.STATUS); the others
(INTERNAL, DATA_LOSS, ABORTED, ...) are failures."""


class _Outage:
    """How long the client goes on reconnecting: an outage may last `reconnect_s`, counted
    from its first failure; backoff doubles from 50 ms to 1 s. An event from the stream
    ends the outage, so a later one gets the whole time again."""

    def __init__(self, address: str, reconnect_s: float) -> None:
        self.address, self.reconnect_s = address, reconnect_s
        self.deadline: float | None = None
        self.backoff = 0.05

    def left(self) -> float:
        """Seconds this outage may still last (all of `reconnect_s` outside one)."""
        if self.deadline is None:
            return self.reconnect_s
        return max(0.0, self.deadline - time.monotonic())

    def over(self) -> None:
        """The stream answered: the next failure starts a new outage."""
        self.deadline, self.backoff = None, 0.05

    def wait(self, exc: Exception) -> None:
        """Sleep before the next try, or raise once this outage has lasted too long."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.reconnect_s
        if time.monotonic() > self.deadline:
            raise ClusterClientError(
                f"proposer at {self.address} unreachable for {self.reconnect_s:.0f}s"
            ) from exc
        time.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, 1.0)

    def ready(self, channel, on_wait) -> None:
        """Wait for the channel to the proposer to connect, for as long as this outage may
        still last (`left`), telling `on_wait` after the first second; a call is only made on
        a connected channel, so that no call waits for a proposer for ever (a call that waits
        for the channel has no deadline)."""
        import grpc

        seconds = self.left()
        future = grpc.channel_ready_future(channel)
        try:
            future.result(timeout=min(1.0, seconds))
            return
        except grpc.FutureTimeoutError:
            pass
        if on_wait is not None:
            on_wait(f"waiting for the proposer at {self.address} (up to {seconds:.0f} s)")
        try:
            future.result(timeout=max(0.0, seconds - 1.0))
        except grpc.FutureTimeoutError:
            future.cancel()
            raise ClusterClientError(
                f"proposer at {self.address} unreachable for {self.reconnect_s:.0f}s"
            ) from None


def _refusal(address: str, exc: Exception, code) -> ClusterClientError:
    """The error a status that is not retried becomes: a refusal (exit 2) or a failure."""
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    error = ClusterRefusedError if name in REFUSALS else ClusterClientError
    return error(f"proposer at {address}: {name}: {details}")


def stream_generate(
    address: str,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    draft_len: int = 0,
    on_event=None,
    on_wait=None,
    reconnect_s: float = 120.0,
    limits: KeepaliveLimits | None = None,
    tls=None,
) -> dict:
    """Generate through the proposer at `address`; returns the --json object of the lane.
    `limits` is the cluster's [limits] (message size and keepalive; None: their defaults),
    `tls` its [tls] section (None: an insecure channel, for loopback). A proposer that does
    not answer is waited for up to `reconnect_s` (`on_wait` hears a line after the first
    second), and a broken stream resumed (module note) for up to as long an outage."""
    import grpc

    from cluster_config.schema import Limits
    from muser.channels import channel_options
    from muser.tls import open_channel
    from muser.wire import convert
    from muser.wire import muser_v2_pb2 as pb
    from muser.wire import muser_v2_pb2_grpc as pb_grpc

    RETRYABLE = (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    )
    options = [
        *channel_options(limits if limits is not None else Limits()),
        ("grpc.initial_reconnect_backoff_ms", 50),  # a restarted proposer is found at once
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    tokens: list[int] = []
    texts: list[str] = []
    session_id = b""
    prompt_tokens, stats = 0, {}
    outage = _Outage(address, reconnect_s)
    start = time.perf_counter()
    with open_channel(address, tls, "client", options=options) as channel:
        stub = pb_grpc.ProposerStub(channel)
        while True:
            outage.ready(channel, on_wait)
            request = pb.GenerateRequest(params=convert.params_to_pb(params), draft_len=draft_len)
            if session_id:
                request.session_id, request.offset = session_id, len(tokens)
            elif isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_tokens.extend(prompt)
            try:
                for event in stub.Generate(request):
                    outage.over()
                    session_id = event.session_id
                    prompt_tokens = event.prompt_tokens
                    if event.offset != len(tokens):
                        raise ClusterClientError(
                            f"stream offset {event.offset} but {len(tokens)} tokens held"
                        )
                    tokens += list(event.tokens)
                    texts.append(event.text)
                    if on_event:
                        on_event(event)
                    if event.done:
                        stats = json.loads(event.stats_json or "{}")
                        break
                else:
                    raise grpc.RpcError("stream ended without a done event")
                break
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                meta = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
                final = ("muser-answer", "final") in tuple(meta or ())  # the proposer's answer
                if not session_id or final or (code is not None and code not in RETRYABLE):
                    raise _refusal(address, exc, code) from exc
                outage.wait(exc)
    wall = time.perf_counter() - start
    stats = {
        **stats,
        "client_wall_s": round(wall, 6),
        "client_tokens_per_s": round(len(tokens) / wall, 3) if wall > 0 else 0.0,
    }
    return {
        "lane": "cluster",
        "text": "".join(texts),
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "session_id": session_id.hex(),
        "stats": stats,
    }


def generate_cluster(args: argparse.Namespace, params: SamplingParams, text: str) -> int:
    from cluster_config import load_config
    from muser.errors import RefusedError

    if not args.config:
        raise RefusedError("--lane cluster needs --config FILE (the cluster.toml)")
    config = load_config(args.config)

    def show(event) -> None:
        sys.stdout.write(event.text)
        sys.stdout.flush()

    if not args.json:
        sys.stdout.write(text)
    result = stream_generate(
        config.proposer.address,
        text,
        params,
        draft_len=args.draft_len or 0,  # 0: the cluster's lane.draft_len
        on_event=None if args.json else show,
        on_wait=lambda line: print(f"muser generate: {line}", file=sys.stderr, flush=True),
        limits=config.limits,
        tls=config.tls,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    s = result["stats"]
    from muser_app.cli._common import stats_table

    split = s.get("split_s", {})
    print("\n")
    print(
        stats_table(
            [
                ("lane", "cluster"),
                ("session", result["session_id"]),
                ("generated tokens", str(len(result["tokens"]))),
                ("rounds", str(s.get("rounds"))),
                ("acceptance", f"{s.get('acceptance', 0):.3f}"),
                ("tokens per round", f"{s.get('tokens_per_round', 0):.2f}"),
                ("tokens/s (client)", f"{s.get('client_tokens_per_s', 0):.1f}"),
                ("round split", ", ".join(f"{k} {v:.3f}s" for k, v in split.items())),
                ("verifier-only ceiling", f"{s.get('verifier_ceiling_tokens_per_s', 0):.1f} tok/s"),
            ]
        )
    )
    return 0
