"""Structured daemon logs: every line about a round carries its session id and round index.

The round being worked on is held in context variables, set where a round starts
(`round_scope` in the verifier's servicer, `set_round` in the proposer's session task).
asyncio tasks and `asyncio.to_thread` copy the context they are started from, so the lines
logged anywhere below (session manager, commit, refusals) carry the fields without passing
them around. An explicit `extra={"session": ..., "round": ...}` wins over the context.

    muser verifier serve --config FILE --log-format json      # one JSON object per line
    {"ts": "...", "level": "INFO", "logger": "muser.verifier", "message": "...",
     "session": "9f2c...", "round": 3}

Text lines end in ` session=<hex> round=<n>` when those are known.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal, TextIO

from muser.errors import InvalidOverrideError

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

_session: ContextVar[str | None] = ContextVar("muser_log_session", default=None)
_round: ContextVar[int | None] = ContextVar("muser_log_round", default=None)

# attributes every LogRecord has; anything else on a record came from `extra`
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _hex(session: bytes | str) -> str:
    return session.hex() if isinstance(session, bytes | bytearray) else str(session)


def set_round(session: bytes | str, round_: int | None) -> None:
    """Set the session and round of the current context (a task's own copy: a session task
    calls this at the top of each round)."""
    _session.set(_hex(session))
    _round.set(round_)


@contextlib.contextmanager
def round_scope(session: bytes | str, round_: int | None = None) -> Iterator[None]:
    """Lines logged inside (and by tasks started inside) carry this session and round."""
    s, r = _session.set(_hex(session)), _round.set(round_)
    try:
        yield
    finally:
        _round.reset(r)
        _session.reset(s)


class ContextFilter(logging.Filter):
    """Copies the context's session and round onto each record (unless `extra` set them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session"):
            record.session = _session.get()
        elif isinstance(record.session, bytes | bytearray):
            record.session = record.session.hex()
        if not hasattr(record, "round"):
            record.round = _round.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        session, round_ = getattr(record, "session", None), getattr(record, "round", None)
        if session is not None:
            line += f" session={session}"
        if round_ is not None:
            line += f" round={round_}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then session/round and any other
    `extra` fields; `exc` holds a formatted traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and value is not None:
                out[key] = value if isinstance(value, int | float | str | bool) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def make_handler(fmt: LogFormat = "text", stream: TextIO | None = None) -> logging.Handler:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    return handler


LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", fmt: LogFormat = "text", stream: TextIO | None = None) -> None:
    """Install one handler on the root logger (replacing any), for a daemon process."""
    if level not in LEVELS:
        raise InvalidOverrideError(
            f"log level {level!r} (--log-level or $MUSER_LOG_LEVEL): expected one of "
            f"{', '.join(LEVELS)}"
        )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(getattr(logging, level.upper()))


def add_arguments(parser) -> None:
    """--log-level and --log-format for a daemon's `serve` (their defaults come from
    MUSER_LOG_LEVEL and MUSER_LOG_FORMAT, so a supervisor or test can switch a whole cluster
    to per-round DEBUG lines or to JSON lines)."""
    parser.add_argument(
        "--log-level",
        default=os.environ.get("MUSER_LOG_LEVEL", "info").lower(),
        choices=LEVELS,
        help="log level of the lines on stderr (default info, or $MUSER_LOG_LEVEL; debug adds "
        "a line per round)",
    )
    default = os.environ.get("MUSER_LOG_FORMAT", "text")
    parser.add_argument(
        "--log-format",
        default=default if default in FORMATS else "text",
        choices=FORMATS,
        help="text lines, or one JSON object per line (default text, or $MUSER_LOG_FORMAT)",
    )
