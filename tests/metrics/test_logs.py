"""Structured logs: a line about a round carries its session id and round index, as JSON
fields in JSON mode and as `session=.. round=..` in text mode."""

from __future__ import annotations

import io
import json
import logging

import pytest

from muser import logs
from muser.sampling import SamplingParams
from muser_app.cli.main import build_parser


@pytest.fixture
def captured():
    """A JSON handler on the muser loggers; yields the stream it writes to."""
    stream = io.StringIO()
    handler = logs.make_handler("json", stream)
    logger = logging.getLogger("muser")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_takes_session_and_round_from_the_scope(captured):
    log = logging.getLogger("muser.test")
    with logs.round_scope(b"\x01\x02", 7):
        log.info("inside %d", 1)
    log.info("outside")
    log.info("explicit", extra={"session": b"\xff", "round": 2})
    inside, outside, explicit = lines(captured)
    assert inside["message"] == "inside 1" and inside["level"] == "INFO"
    assert (inside["session"], inside["round"], inside["logger"]) == ("0102", 7, "muser.test")
    assert "session" not in outside and "round" not in outside
    assert (explicit["session"], explicit["round"]) == ("ff", 2)


def test_text_line_ends_in_session_and_round():
    stream = io.StringIO()
    record = logging.LogRecord("muser.x", logging.INFO, __file__, 1, "hello", None, None)
    handler = logs.make_handler("text", stream)
    with logs.round_scope("abcd", 3):
        handler.handle(record)
    assert stream.getvalue().rstrip().endswith("INFO muser.x hello session=abcd round=3")


def test_log_format_flag_on_both_daemons(monkeypatch):
    parser = build_parser()
    for role in ("verifier", "proposer"):
        args = parser.parse_args([role, "serve", "--config", "c.toml", "--log-format", "json"])
        assert args.log_format == "json"
        with pytest.raises(SystemExit):
            parser.parse_args([role, "serve", "--config", "c.toml", "--log-format", "xml"])
    monkeypatch.setenv("MUSER_LOG_FORMAT", "json")
    args = build_parser().parse_args(["verifier", "serve", "--config", "c.toml"])
    assert args.log_format == "json"


def test_log_level_comes_from_the_flag_then_the_environment(monkeypatch):
    serve = ["proposer", "serve", "--config", "c.toml"]
    assert build_parser().parse_args(serve).log_level == "info"
    monkeypatch.setenv("MUSER_LOG_LEVEL", "DEBUG")
    assert build_parser().parse_args(serve).log_level == "debug"
    assert build_parser().parse_args([*serve, "--log-level", "error"]).log_level == "error"


def test_a_bad_log_level_from_the_environment_is_refused(monkeypatch):
    from muser.errors import InvalidOverrideError

    monkeypatch.setenv("MUSER_LOG_LEVEL", "loud")
    args = build_parser().parse_args(["verifier", "serve", "--config", "c.toml"])
    root = logging.getLogger()
    handlers = list(root.handlers)
    with pytest.raises(
        InvalidOverrideError,
        match=r"log level 'loud' \(--log-level or \$MUSER_LOG_LEVEL\): expected one of debug, info, warning, error",
    ):
        logs.configure(args.log_level, args.log_format)
    assert root.handlers == handlers  # nothing was installed


@pytest.mark.asyncio
async def test_verifier_round_lines_carry_session_and_round(verifier, captured):
    logging.getLogger("muser").setLevel(logging.DEBUG)  # one line per round, at DEBUG
    client = verifier.client(SamplingParams(temperature=1.0, max_tokens=12, seed=9))
    await client.open_session()
    stream = await client.attach()
    await client.run(stream)
    await stream.close()
    rounds = [e for e in lines(captured) if "accepted" in e["message"]]
    assert len(rounds) == len(client.results) > 1
    for index, entry in enumerate(rounds):
        assert entry["session"] == client.session_id.hex()
        assert entry["round"] == index
        assert entry["logger"] == "muser.verifier"
