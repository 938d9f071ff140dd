"""Regenerate the committed stubs from proto/ with the pinned grpcio-tools.

    python -m muser.wire.regen [--out DIR]

The proto lives at proto/muser/wire/muser_v2.proto so the generated imports
(`from muser.wire import muser_v2_pb2`) resolve inside this package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "muser/wire/muser_v2.proto"


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--pyi_out={out}",
            str(ROOT / "proto" / PROTO),
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
