"""`muser status --config FILE [--wait S] [--json]`: health and statistics of both daemons.

Exit 0 when both daemons answer the standard gRPC health check with SERVING (waiting up to
--wait seconds for that), 1 when either does not.
"""

from __future__ import annotations

import argparse
import json
import time


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--config", required=True, help="cluster.toml")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for SERVING")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def probe(address: str, service: str, timeout: float = 2.0) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from muser.wire import muser_v2_pb2 as pb
    from muser.wire import muser_v2_pb2_grpc as pb_grpc

    out: dict = {"address": address, "serving": False}
    with grpc.insecure_channel(address) as channel:
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
            "verifier": probe(config.verifier.address, "verifier"),
            "proposer": probe(config.proposer.address, "proposer"),
        }
        healthy = all(r["serving"] for r in report.values())
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    report["healthy"] = healthy
    if args.json:
        print(json.dumps(report))
    else:
        for role in ("verifier", "proposer"):
            r = report[role]
            state = "SERVING" if r["serving"] else f"DOWN ({r.get('error', 'not serving')})"
            print(f"{role:<9} {r['address']:<22} {state}")
            for key, value in r.get("status", {}).items():
                print(f"  {key}: {value}")
    return 0 if healthy else 1
