"""Helpers for the integration tests: daemons as subprocesses, and the CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from muser_app.procs import Daemon

REPO = Path(__file__).resolve().parents[2]

__all__ = ["Daemon", "muser"]


def muser(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "muser_app.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def stop_in_process(proposer, verifier) -> None:
    """Stop daemons a test built with `create_server` in its own process: the proposer's
    HTTP API, its server and core, then the verifier."""
    if getattr(proposer, "http", None) is not None:
        await proposer.http.cleanup()
    await proposer.stop(None)
    await proposer.core.close()
    await verifier.stop(None)
