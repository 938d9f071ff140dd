"""Daemons as child processes (`muser_app.procs.Daemon`): each start waits for the "listening on"
line of its own output, in a log that keeps every earlier start's output.

The log holds multi-byte characters (transformers' progress bars: three bytes a block), so
this start's output is found from a byte offset: read as a character index, the offset ran
past the new output after about twenty restarts of the verifier and a start that had come up
was taken for one that had not (found by the slow suite's hundred-kill crash sweep)."""

from __future__ import annotations

import sys

import pytest

from muser_app.procs import Daemon, DaemonError

BAR = "Loading weights: 100%|" + "█" * 10 + "| 92/92\n"


class Scripted(Daemon):
    """A daemon whose process prints `lines` (then sleeps, as a server would)."""

    def __init__(self, tmp_path, lines: list[str]):
        super().__init__("verifier", tmp_path / "cluster.toml", tmp_path)
        self.lines = lines

    def command(self) -> list[str]:
        text = "".join(self.lines)
        return [sys.executable, "-c", f"import sys, time; sys.stdout.write({text!r}); "
                "sys.stdout.flush(); time.sleep(60)"]  # fmt: skip


def test_the_command_is_muser_role_serve_with_the_config(tmp_path):
    daemon = Daemon("proposer", tmp_path / "c.toml", tmp_path)
    assert daemon.command()[1:] == [
        "-m", "muser_app.cli.main", "proposer", "serve", "--config", str(tmp_path / "c.toml"),
    ]  # fmt: skip


def test_every_start_finds_its_own_listening_line_after_many_progress_bars(tmp_path):
    daemon = Scripted(tmp_path, [BAR * 3, "verifier listening on 127.0.0.1:1\n"])
    try:
        for _ in range(30):  # 30 starts: 1800 bytes more than characters before the last
            daemon.start(timeout=20)
            daemon.kill()
    finally:
        daemon.kill()
    log = daemon.log_path.read_text()
    assert daemon.starts == 30 and log.count("listening on") == 30
    assert len(log.encode()) - len(log) == 30 * 3 * 10 * 2


def test_an_earlier_starts_listening_line_does_not_count(tmp_path):
    daemon = Scripted(tmp_path, [BAR, "verifier listening on 127.0.0.1:1\n"])
    daemon.start(timeout=20)
    daemon.kill()
    daemon.lines = [BAR, "still loading\n"]  # this time it never comes up
    with pytest.raises(DaemonError, match=r"verifier did not start in 2s:(.|\n)*still loading"):
        daemon.start(timeout=2)
    assert not daemon.alive()


def test_a_daemon_that_exits_is_reported_with_its_output(tmp_path):
    daemon = Scripted(tmp_path, [BAR, "bad config: no [verifier] table\n"])
    daemon.command = lambda: [sys.executable, "-c", "print('bad config ▶ no table'); exit(2)"]
    with pytest.raises(DaemonError, match="verifier exited 2:\n.*bad config ▶ no table"):
        daemon.start(timeout=20)


def test_the_environment_given_reaches_the_daemon(tmp_path):
    """`env` is set over this process's own (a bench variant's PYTHONPATH)."""

    class Echo(Scripted):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "import os, sys, time; "
                    "print('MUSER_X=' + os.environ['MUSER_X'], 'PATH' in os.environ); "
                    "print('verifier listening on 127.0.0.1:1', flush=True); time.sleep(60)"]  # fmt: skip

    daemon = Echo(tmp_path, [])
    daemon.env = {"MUSER_X": "from-the-bench"}
    try:
        daemon.start(timeout=20)
    finally:
        daemon.kill()
    assert "MUSER_X=from-the-bench True" in daemon.log_path.read_text()


def test_a_variants_pythonpath_wins_over_the_working_directory(tmp_path):
    """A bench variant's daemons run its checkout's code (`code=PATH` sets PYTHONPATH), even
    when the bench runs from another checkout: `-m` alone would put the working directory
    (here this repository) first on the path."""
    import subprocess
    from pathlib import Path

    other = tmp_path / "other"
    (other / "muser_app" / "cli").mkdir(parents=True)
    for package in ("muser_app", "muser_app/cli"):
        (other / package / "__init__.py").write_text("")
    (other / "muser_app" / "cli" / "main.py").write_text("print('other checkout')\n")
    repo = Path(__file__).resolve().parents[2]
    daemon = Daemon("verifier", tmp_path / "cluster.toml", tmp_path, {"PYTHONPATH": str(other)})
    out = subprocess.run(daemon.command(), cwd=repo, env={"PYTHONPATH": str(other)},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout == "other checkout\n", out.stderr
    plain = Daemon("verifier", tmp_path / "cluster.toml", tmp_path).command()
    assert "-P" not in plain  # (no PYTHONPATH of its own: this interpreter's own path)
