"""Daemons as child processes: the demo, the bench and the integration tests start them so.

`Daemon(role, config, log_dir)` runs `muser ROLE serve --config FILE` with stdout/stderr in
a log file, waits for its "listening on" line, and can stop it (SIGTERM) or kill it
(SIGKILL, what a power cut looks like to the process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from muser.errors import MuserError


class DaemonError(MuserError):
    """A daemon exited or did not come up in time; the message holds its log tail."""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used so far, all its threads, from Linux's
    /proc/<pid>/stat (clock ticks: 10 ms steps on this machine). None where there is no /proc
    (macOS) or no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_since(daemons: dict) -> Callable[[], dict[str, float]]:
    """Read the CPU of each of `daemons` ({role: Daemon}) now; the call returned gives the
    seconds each has spent since, leaving out any whose CPU could not be read either time."""
    before = {role: d.cpu_s() for role, d in daemons.items()}

    def spent() -> dict[str, float]:
        after = {role: d.cpu_s() for role, d in daemons.items()}
        return {r: after[r] - before[r] for r in daemons if None not in (before[r], after[r])}

    return spent


class Daemon:
    def __init__(self, role: str, config: Path, log_dir: Path, env: dict[str, str] | None = None):
        self.role, self.config = role, Path(config)
        self.env = dict(env or {})
        """Set in the daemon's environment, over this process's (a bench variant's
        PYTHONPATH, to run another checkout's code)."""
        self.log_path = Path(log_dir) / f"{role}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 180.0) -> None:
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"\n--- start {self.starts} ---\n")
        offset = self.log_path.stat().st_size
        log = self.log_path.open("a")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # this start's output: from a byte offset (the log holds multi-byte characters,
            # progress bars among them, so a character index drifts further every start)
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if f"{self.role} listening on" in text:
                return
            if self.proc.poll() is not None:
                raise DaemonError(f"{self.role} exited {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.05)
        self.kill()
        raise DaemonError(f"{self.role} did not start in {timeout:.0f}s:\n{self.log_tail()}")

    def command(self) -> list[str]:
        """The daemon's command line: `muser ROLE serve --config FILE` in this interpreter.
        Under a PYTHONPATH of its own (a bench variant's checkout) with `-P`: `-m` would
        otherwise put the working directory first on the path, and a bench started from
        a checkout would run that checkout's code as the variant's too."""
        isolated = ["-P"] if "PYTHONPATH" in self.env else []
        return [sys.executable, *isolated, "-m", "muser_app.cli.main", self.role, "serve",
                "--config", str(self.config)]  # fmt: skip

    def cpu_s(self) -> float | None:
        """CPU seconds this daemon has used so far (`cpu_seconds`); None when not running."""
        return cpu_seconds(self.proc.pid) if self.alive() else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc else None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
