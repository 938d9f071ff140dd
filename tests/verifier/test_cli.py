"""`muser verifier serve`: the listening line, SIGKILL and restart on the same commit log,
clean SIGTERM shutdown, and exit code 2 for a bad cluster file."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import socket
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from cluster_config.schema import ConfigError
from muser.keys import key_id
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from muser_app.cli import verifier as verifier_cli
from muser_app.cli.config import free_ports
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import PROMPT
from tests.verifier.lane_client import LaneClient, identity_of
from verifier_gx.journal_check import VerifierJournal
from wal.log import FileLog

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"verifier listening on 127\.0\.0\.1:(\d+) key=([0-9a-f]{16})")
LAUNCHER = """\
import argparse, sys
sys.path.insert(0, {repo!r})
import verifier_gx.backends
from tests.core.fake_backend import FakeBackend
verifier_gx.backends.load_target_backend = lambda kind, path, **opts: FakeBackend()
import cluster_config.qualification  # the fake target has no checkpoint to qualify
cluster_config.qualification.require_receipt = lambda config: None
import verifier_gx.daemon  # so no receipt names a qualified draft either
verifier_gx.daemon._qualified_lane = lambda config: (None, None)
import cluster_config.rules as rules  # nor a checkpoint directory to check
rules.RULES = tuple(r for r in rules.RULES if r is not rules.model_directories)
from muser_app.cli.verifier import register
parser = argparse.ArgumentParser(prog="muser")
register(parser.add_subparsers(), "verifier", "verifier daemon")
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def write_config(key_set, tmp_path: Path) -> Path:
    d = key_set.dir
    path = tmp_path / "cluster.toml"
    verifier_port, proposer_port = free_ports(2)
    path.write_text(
        textwrap.dedent(f"""\
        [verifier]
        address = "127.0.0.1:{verifier_port}"
        key = "{d / "verifier.key"}"
        public_key = "{d / "verifier.pub"}"
        wal_dir = "wal"
        target = "no-target"

        [proposer]
        address = "127.0.0.1:{proposer_port}"
        key = "{d / "proposer.key"}"
        public_key = "{d / "proposer.pub"}"
        wal_dir = "proposer-wal"
        draft = "no-draft"

        [enrolment]
        verifiers = ["{d / "verifier.pub"}"]
        proposers = ["{d / "proposer.pub"}"]
        """)
    )
    return path


async def start(launcher: Path, config: Path, *flags: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(launcher), "verifier", "serve", "--config", str(config), *flags,
        cwd=REPO, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    lines = []
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        if not line:
            raise AssertionError(f"verifier exited before listening: {b''.join(lines)!r}")
        lines.append(line)
        if match := LISTENING.search(line.decode()):
            return proc, int(match.group(1)), match.group(2)


@pytest.mark.asyncio
async def test_serve_kill_restart_and_clean_stop(key_set, tmp_path):
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=4)
    reference = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params,
                          draft_len=3, q_top_k=5).tokens  # fmt: skip
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    config = write_config(key_set, tmp_path)
    proc, port, kid = await start(launcher, config)
    assert kid == key_id(key_set.verifier.public_key())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = LaneClient(
        pb_grpc.VerifierStub(channel), key_set.proposer, key_set.verifier.public_key(),
        identity_of(FakeBackend()), FakeBackend(order=1, salt=1), params, list(PROMPT),
    )  # fmt: skip
    await client.open_session()
    await client.run(await client.attach(), rounds=3)
    proc.kill()  # a crash: no shutdown, the kernel drops the WAL lock
    await proc.wait()
    await channel.close()

    proc, port2, _ = await start(launcher, config, "--log-level", "debug")
    assert port2 == port
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client.stub = pb_grpc.VerifierStub(channel)
    reply = await client.open_session(fragments={})
    assert (reply.next_round, reply.head) == (3, client.head)
    await client.run(await client.attach())
    assert client.out == reference
    await channel.close()
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, stderr.decode()
    # each round is logged at DEBUG (the restarted daemon runs with --log-level debug)
    assert re.search(rf"session {client.session_id.hex()[:8]} round 4: accepted", stderr.decode())
    with FileLog(tmp_path / "wal" / "commit") as log:  # the lock was released
        report = VerifierJournal().verify(
            log.records(), verifier_keys={kid: key_set.verifier.public_key()}
        )
    assert report.ok and report.sessions[0]["rounds"] == client.next_round


def test_config_errors_exit_2(tmp_path, key_set, capsys):
    from muser_app.cli import main as cli_main

    parser = argparse.ArgumentParser(prog="muser")
    verifier_cli.register(parser.add_subparsers(), "verifier", "verifier daemon")
    args = parser.parse_args(["verifier", "serve", "--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError) as caught:
        args.func(args)
    assert caught.value.exit_code == 2 and "missing.toml" in str(caught.value)
    # through the dispatcher, once the subcommand is in its table
    table = {"verifier": ("muser_app.cli.verifier", "verifier daemon")}
    bad = write_config(key_set, tmp_path)
    bad.write_text(bad.read_text().replace("[verifier]", "[verifier]\nport = 1"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_main, "SUBCOMMANDS", table)
        assert cli_main.main(["verifier", "serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "verifier.port" in err
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["verifier"])
    assert caught.value.code == 2


def test_mismatched_verifier_key_pair_is_refused(key_set, tmp_path):
    config = write_config(key_set, tmp_path)
    text = config.read_text().replace(
        f'public_key = "{key_set.dir / "verifier.pub"}"',
        f'public_key = "{key_set.dir / "stranger.pub"}"',
        1,
    )
    config.write_text(text)
    from cluster_config import load_config
    from verifier_gx.daemon import create_server

    with pytest.raises(ConfigError, match="not the public half"):
        create_server(load_config(config), backend=FakeBackend())


@pytest.mark.asyncio
async def test_taken_port_is_a_config_error(key_set, tmp_path):
    from tests.verifier.conftest import make_config
    from verifier_gx.daemon import create_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(key_set, tmp_path / "wal")
        verifier = config.verifier.model_copy(update={"address": f"127.0.0.1:{port}"})
        config = config.model_copy(update={"verifier": verifier})
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
            create_server(config, backend=FakeBackend(), unqualified="fake target")
    with FileLog(tmp_path / "wal" / "commit"):  # the refused start released the log
        pass
