"""What every `kvledger` command shares: how it logs, and how it reads an address."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
import structlog
import typer

from coordinator.audit.answers import AuditError
from events.log import LogError, NotALog
from events.log.opening import BadLogUrl

BAD_INPUT: tuple[type[Exception], ...] = (AuditError, NotALog, BadLogUrl)
"""What a command was asked wrongly (exit code 2); a log that fails is exit code 1."""


def host_port(text: str | None, option: str) -> tuple[str, int] | None:
    """HOST:PORT (IPv6 in brackets) as a tuple; "off" or empty: None."""
    if not text or text.lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise typer.BadParameter(f"{text!r} is not HOST:PORT", param_hint=option)
    return host.strip("[]"), int(port)


def configure_json_logs() -> None:
    """structlog JSON lines on stderr: what a sidecar's log collector reads. The level comes
    from $KVLEDGER_LOG_LEVEL (default info; debug adds a line per committed step)."""
    level = logging.getLevelNamesMapping().get(os.environ.get("KVLEDGER_LOG_LEVEL", "info").upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def quiet_logs() -> None:
    """Forensic commands print answers on stdout; their logs go to stderr, warnings and up
    unless $KVLEDGER_LOG_LEVEL says otherwise."""
    level = logging.getLevelNamesMapping().get(os.environ.get("KVLEDGER_LOG_LEVEL", "warning").upper(), logging.WARNING)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level), logger_factory=structlog.PrintLoggerFactory(sys.stderr)
    )


@contextmanager
def exits(command: str, *, bad_input: tuple[type[Exception], ...] = BAD_INPUT) -> Iterator[None]:
    """The one mapping of errors to exit codes: bad input ends with its message and exit code
    2; a log, its database or a file that cannot be written, with exit code 1; never a traceback."""
    try:
        yield
    except bad_input as error:
        typer.echo(f"kvledger {command}: {error}", err=True)
        raise typer.Exit(code=2) from None
    except LogError as error:
        typer.echo(f"kvledger {command}: {error}", err=True)
        raise typer.Exit(code=1) from None
    except sa.exc.SQLAlchemyError as error:  # the database failed mid-read (locked, connection lost)
        first = str(error).splitlines()[0]
        typer.echo(f"kvledger {command}: the log's database failed: {first}", err=True)
        raise typer.Exit(code=1) from None
    except OSError as error:  # mostly writing --out: a full disk, no permission
        where = f"{error.filename}: " if error.filename else ""
        typer.echo(f"kvledger {command}: {where}{error.strerror or error}", err=True)
        raise typer.Exit(code=1) from None
