"""Generated protobuf/gRPC stubs for proto/muser/wire/muser_v2.proto (package muser.v2).

Regenerate with `python -m muser.wire.regen`; a test fails when the committed stubs differ
from what the pinned grpcio-tools generates. Generated types never leave the servicer and
driver modules: inside, state is plain dataclasses (muser.records).
"""
