"""The hook through which `muser wal inspect/verify` understand round records.

The log stores opaque payloads; only the code that defines round records (the wire
package) knows their layout. It plugs in like this:

    from wal.interpret import register_interpreter

    class RoundInterpreter:
        name = "round-v1"

        def describe(self, payload: bytes) -> dict | None:
            # {"session": str, "round": int, "head": hex str} for a round record,
            # None for any payload it does not recognise (other interpreters may)
            ...

        def check_chain(self, records, pubkeys, snapshot) -> str | None:
            # records: every readable Record(seq, payload) in seq order, from the first
            #   retained one; snapshot: the latest Snapshot(seq, data) or None (the heads
            #   of sessions whose early rounds were compacted away live in it)
            # pubkeys: the raw bytes of each `--pubkey FILE`, in order
            # returns None when every hash link and signature holds, else the first failure
            # as one line naming the seq, session and round
            ...

    register_interpreter(RoundInterpreter())

and makes the CLI import that module: the application names "package.module" (which
registers on import) or "package.module:attr" (an instance or a zero-argument class,
registered for you) in the specs it hands `load_interpreters` (the daemons' own are
`muser_app.cli.wal.DAEMON_INTERPRETERS`: storage names no package above it), or the
operator passes `--interpreter SPEC` on the command line.

With nothing registered, verify checks what the log itself guarantees: segment headers,
every checksum, sequence numbers contiguous across segments, snapshot integrity.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from wal.base import Record, Snapshot
from wal.errors import WalError, WalUsageError


@runtime_checkable
class RecordInterpreter(Protocol):
    name: str

    def describe(self, payload: bytes) -> dict | None: ...

    def check_chain(
        self, records: Iterable[Record], pubkeys: Sequence[bytes], snapshot: Snapshot | None
    ) -> str | None: ...


_registry: list[RecordInterpreter] = []


def register_interpreter(interpreter: RecordInterpreter) -> None:
    """Add an interpreter (idempotent: one interpreter per name is kept)."""
    if not isinstance(interpreter, RecordInterpreter):
        raise WalUsageError(
            f"{interpreter!r} is not a RecordInterpreter: it needs a `name`, "
            "describe(payload) and check_chain(records, pubkeys, snapshot)"
        )
    if not any(
        existing is interpreter or existing.name == interpreter.name for existing in _registry
    ):
        _registry.append(interpreter)


def unregister_interpreter(interpreter: RecordInterpreter) -> None:
    _registry[:] = [existing for existing in _registry if existing is not interpreter]


def registered_interpreters() -> tuple[RecordInterpreter, ...]:
    return tuple(_registry)


def load_interpreter(spec: str) -> None:
    """Import "module" (which registers itself) or "module:attr" (registered here)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as exc:  # ValueError, TypeError: "", ".x"
        raise WalError(f"cannot import record interpreter module {module_name!r}: {exc}") from exc
    if not attr:
        return
    try:
        target = getattr(module, attr)
    except AttributeError as exc:
        raise WalError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if isinstance(target, type):
        try:
            target = target()
        except TypeError as exc:
            raise WalUsageError(
                f"record interpreter {spec!r}: class {attr!r} cannot be made with no arguments "
                f"({exc}); expected an interpreter instance or a zero-argument class"
            ) from exc
    register_interpreter(target)


def load_requested_interpreter(spec: str) -> None:
    """Load an interpreter the operator asked for (`--interpreter SPEC`). One that cannot be
    imported or found is bad input, refused (exit 2) naming SPEC and what is registered."""
    try:
        load_interpreter(spec)
    except WalUsageError:
        raise
    except WalError as exc:
        names = ", ".join(i.name for i in registered_interpreters()) or "none"
        raise WalUsageError(
            f"--interpreter {spec!r}: {exc}; expected MODULE or MODULE:ATTR naming an "
            f"importable record interpreter (registered interpreters: {names})"
        ) from exc


def load_interpreters(
    builtin: Iterable[str], extra: Iterable[str] = ()
) -> tuple[RecordInterpreter, ...]:
    """Load the application's `builtin` specs (one that cannot be loaded is a broken
    installation: a runtime error) and `extra` specs (the operator's, refused when they
    cannot be loaded); return everything registered."""
    for spec in builtin:
        load_interpreter(spec)
    for spec in extra:
        load_requested_interpreter(spec)
    return registered_interpreters()


def describe(payload: bytes) -> dict | None:
    """The first registered interpreter's description of a payload, if any has one."""
    for interpreter in _registry:
        found = interpreter.describe(payload)
        if found is not None:
            return found
    return None
