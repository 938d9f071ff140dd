"""Real daemons as subprocesses on loopback, for integration and crash tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Daemon:
    """`muser ROLE serve --config FILE` in a subprocess; stderr goes to a log file."""

    def __init__(self, role: str, config: Path, log_dir: Path):
        self.role, self.config = role, config
        self.log_path = log_dir / f"{role}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120.0) -> None:
        self.starts += 1
        log = self.log_path.open("a")
        log.write(f"\n--- start {self.starts} ---\n")
        log.flush()
        offset = self.log_path.stat().st_size
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "muser.cli.main",
                self.role,
                "serve",
                "--config",
                str(self.config),
            ],
            stdout=log,
            stderr=log,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text()[offset:]
            if f"{self.role} listening on" in text:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.role} did not start in {timeout}s:\n{self.log_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, no flush — what a power cut looks like to the process."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def muser(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "muser.cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
