"""muser-cluster: lossless speculative decoding split across two machines.

`muser` is the core (docs/architecture.md, docs/architecture.md): what both sides must agree on bit
for bit — the pinned MT19937 stream, sampling and verification math, round geometry,
canonical encodings, hashing, signatures, the wire stubs — and the small plumbing both
daemons share (logs, metrics, TLS, CPU pinning). It imports only `wal` below it; the CLI,
the bench and the fixture builder live above the daemons, in `muser_app`.
"""

__version__ = "0.1.0"
