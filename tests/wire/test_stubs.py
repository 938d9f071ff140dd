"""The committed gRPC stubs are exactly what the pinned grpcio-tools generates from proto/."""

from pathlib import Path

from muser.wire.regen import ROOT, generate

STUBS = ["muser_v2_pb2.py", "muser_v2_pb2.pyi", "muser_v2_pb2_grpc.py"]


def test_regenerated_stubs_equal_the_committed_ones(tmp_path):
    generate(tmp_path)
    for name in STUBS:
        fresh = (tmp_path / "muser" / "wire" / name).read_bytes()
        committed = (ROOT / "muser" / "wire" / name).read_bytes()
        assert fresh == committed, (
            f"muser/wire/{name} is stale: run `python -m muser.wire.regen` and commit the result"
        )


def test_proto_declares_the_versioned_package():
    text = (Path(ROOT) / "proto" / "muser" / "wire" / "muser_v2.proto").read_text()
    assert "package muser.v2;" in text
