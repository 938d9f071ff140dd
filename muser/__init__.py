"""muser-cluster: lossless speculative decoding split across two machines.

`muser` holds what both sides must agree on bit for bit (DESIGN.md §3): the pinned MT19937
stream, sampling and verification math, canonical encodings, hashing, signatures, fragments,
the CLI entry point and the fixture-model builder.
"""

__version__ = "0.1.0"
