"""`muser status --config FILE [--wait S] [--json]`: health and statistics of both daemons.

Exit 0 when both daemons answer the standard gRPC health check with SERVING (waiting up to
--wait seconds for that), 1 when either does not; with a [[pool]], each pool verifier is
probed too, and one verifier serving is enough (sessions move off the others). The
proposer's lines say where its sessions live: per verifier, and each session's verifier,
epoch and moves. The statistics come from each daemon's
Status RPC (its JSON carries the `muser.metrics.status_fields`), so this works remotely:
sessions, acceptance, tokens/s over the last minute, WAL bytes on disk, fsync p50/p99, and
the Python collector's frozen objects and pauses (`muser.heap`).
"""

from __future__ import annotations

import argparse
import json
import math
import time


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0 (NaN and negatives refused, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also false for NaN
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


_seconds.__name__ = "a number of seconds >= 0"  # what argparse names in its own messages


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--config", required=True, help="cluster.toml")
    p.add_argument(
        "--wait", type=_seconds, default=0.0, help="seconds to wait for SERVING (default 0)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def probe(address: str, service: str, timeout: float = 2.0, tls=None) -> dict:
    """Health and Status of one daemon; under `tls` (the [tls] section) as the client."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from muser.tls import open_channel
    from muser.wire import muser_v2_pb2 as pb
    from muser.wire import muser_v2_pb2_grpc as pb_grpc

    out: dict = {"address": address, "serving": False}
    with open_channel(address, tls, "client") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
            out["serving"] = reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = (pb_grpc.VerifierStub if service == "verifier" else pb_grpc.ProposerStub)(
                channel
            )
            out["status"] = json.loads(
                stub.Status(pb.StatusRequest(), timeout=timeout).json or "{}"
            )
        except grpc.RpcError as exc:
            out["error"] = f"{exc.code().name}: {exc.details()}"
    return out


def run(args: argparse.Namespace) -> int:
    from cluster_config import load_config

    config = load_config(args.config)
    deadline = time.monotonic() + args.wait
    while True:
        report = {
            "verifier": probe(config.verifier.address, "verifier", tls=config.tls),
            "proposer": probe(config.proposer.address, "proposer", tls=config.tls),
        }
        pool = {v.name: probe(v.address, "verifier", tls=config.tls) for v in config.pool}
        if pool:
            report["pool"] = pool
        verifiers = [report["verifier"], *pool.values()]
        # with a pool, sessions move off a verifier that is down: one serving is enough
        healthy = report["proposer"]["serving"] and (
            any(r["serving"] for r in verifiers) if pool else report["verifier"]["serving"]
        )
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    report["healthy"] = healthy
    if args.json:
        print(json.dumps(report))
    else:
        rows = [("verifier", report["verifier"])]
        rows += [(f"pool {name}", r) for name, r in report.get("pool", {}).items()]
        for role, r in [*rows, ("proposer", report["proposer"])]:
            print(f"{role:<9} {r['address']:<22} {state_line(r)}")
            for line in summary(r.get("status", {})):
                print(f"  {line}")
    return 0 if healthy else 1


def state_line(r: dict) -> str:
    """SERVING; NOT SERVING with each standing fault (the daemon answered); or DOWN (it
    did not answer)."""
    if r["serving"]:
        return "SERVING"
    faults = (r.get("status") or {}).get("faults") or {}
    if faults:
        return "NOT SERVING (" + "; ".join(f"{c}: {why}" for c, why in faults.items()) + ")"
    if "status" in r:
        return "NOT SERVING"
    return f"DOWN ({r.get('error', 'not serving')})"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _sizes(histogram: dict | None) -> str:
    """{"1": 115, "2": 14} as "1×115 2×14" (batch size × batches)."""
    items = sorted((int(k), n) for k, n in (histogram or {}).items())
    return " ".join(f"{k}×{n}" for k, n in items) or "-"


def _forward(kind: str | None) -> str:
    """The status line suffix naming the torch forward (lean or transformers; none for others)."""
    return f", {kind} forward" if kind else ""


def _cpus(cpus: list[int] | None) -> str:
    """The status line suffix naming the CPUs a pinned daemon runs on (its Status says None
    when it may run on every CPU of its machine)."""
    return ", CPUs " + " ".join(map(str, cpus)) if cpus else ""


def pool_lines(pool: dict, limit: int = 20) -> list[str]:
    """Where the proposer's sessions live: per verifier, then each session (its verifier,
    epoch and moves; the first `limit`)."""
    if len(pool.get("verifiers") or []) < 2:
        return []  # one verifier: nothing can move
    placed = pool.get("placement") or {}
    lines = [
        "pool "
        + ", ".join(f"{name} {n} session(s)" for name, n in placed.items())
        + f"; new sessions open on {pool.get('current')}; moves {pool.get('moves', 0)}, "
        f"fences {pool.get('fences', 0)}"
    ]
    sessions = pool.get("sessions") or []
    for row in sessions[:limit]:
        lines.append(
            f"  session {row['session'][:16]} on {row['verifier']} epoch {row['epoch']} "
            f"moved {row['moves']}x, {row['tokens']} tokens"
        )
    if len(sessions) > limit:
        lines.append(f"  ... and {len(sessions) - limit} more (--json lists them)")
    return lines


def summary(status: dict) -> list[str]:
    """The human lines of one daemon's Status JSON."""
    if not status:
        return []
    wal = status.get("wal") or {}
    refusals = status.get("refusals") or {}
    lines = [
        f"key {status.get('key_id', '-')}  up {status.get('uptime_s', 0):.0f}s",
        f"sessions {status.get('sessions', 0)} (open {status.get('open_sessions', 0)})  "
        f"rounds {status.get('rounds', 0)}  tokens {status.get('emitted', 0)}  "
        f"acceptance {status.get('acceptance', 0.0):.3f}  "
        f"tokens/s {status.get('tokens_per_s', 0.0):.1f} (last minute)",
        f"wal {_bytes(wal.get('bytes'))} in {wal.get('dir', '-')}  "
        f"fsync p50 {_ms(wal.get('fsync_p50_s'))} p99 {_ms(wal.get('fsync_p99_s'))} "
        f"({wal.get('fsyncs', 0)} fsyncs)",
    ]
    if status.get("draft_device"):
        lines.append(
            f"draft on {status['draft_device']}"
            + _forward(status.get("draft_forward"))
            + _cpus(status.get("cpus"))
        )
    target = status.get("target") or {}
    if target.get("device"):
        lines.append(
            f"target on {target['device']}"
            + _forward(target.get("forward"))
            + _cpus(status.get("cpus"))
        )
    batching, drafting = status.get("batching") or {}, status.get("drafting") or {}
    if batching.get("batches"):
        lines.append(
            f"target batches {batching['batches']} (mean {batching.get('mean_batch', 0):.2f} "
            f"rounds, sizes {_sizes(batching.get('batch_sizes'))})  queue now "
            f"{batching.get('queue_depth', 0)}, max {batching.get('queue_depth_max', 0)}, "
            f"refused full {batching.get('queue_full', 0)}"
        )
    if drafting.get("batch_sizes"):
        state = "on" if drafting.get("batch") else "off (lane.draft_batch)"
        lines.append(f"draft batches {state}: sizes {_sizes(drafting['batch_sizes'])}")
    if status.get("resumes"):
        lines.append(f"resumed {status['resumes']} session(s) from a proposer's signed round")
    if status.get("verifier_ceiling_tok_s") is not None:
        lines.append(f"verifier-only ceiling {status['verifier_ceiling_tok_s']:.1f} tokens/s")
    if refusals:
        lines.append("refusals " + ", ".join(f"{k} {v}" for k, v in sorted(refusals.items())))
    lines += pool_lines(status.get("pool") or {})
    gc = status.get("gc") or {}
    if gc.get("watched"):
        passes = "/".join(str(n) for n in gc["collections"])
        lines.append(
            f"gc {gc['frozen']} objects frozen; collections {passes} (generations 0/1/2), "
            f"paused {_ms(sum(gc['pause_s']))} in all, longest {_ms(gc['pause_max_s'])}"
        )
    return lines
