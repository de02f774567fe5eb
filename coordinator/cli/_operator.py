"""What the operator's commands share (`kvledger namespace`, `kvledger jobs`): their options,
where a command is recorded (through the running sidecar, or directly on the log when none serves
it), and how a run ends (one line and exit code 1 on a log or recording error)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
import msgspec
import structlog
import typer

from coordinator.cli._common import host_port
from coordinator.client import Address, OperatorClient, SidecarError, SidecarUnavailable, sidecar_answers
from coordinator.core.commands import AnyCommand
from coordinator.ledger.ledger import Ledger
from events import Event
from events.log import LogError, data_dir
from events.log.opening import open_existing

LOG = typer.Option(
    None,
    "--log",
    envvar="KVLEDGER_LOG",
    help="Record directly on this log (SQLite path or URL, or PostgreSQL URL) when no sidecar serves it.",
)
SOCKET = typer.Option(None, "--socket", envvar="KVLEDGER_SOCKET", help="Record through the sidecar on this Unix socket.")
TCP = typer.Option(None, "--tcp", envvar="KVLEDGER_TCP", help="Record through the sidecar at TCP HOST:PORT (needs --token).")
TOKEN = typer.Option(
    "",
    "--token",
    envvar="KVLEDGER_TOKEN",
    help="The sidecar's shared secret (TCP), or a token of its --credentials (TCP or socket).",
    show_default=False,
)
COMMAND_ID = typer.Option(None, "--command-id", help="Make a retry exactly once: the same id returns the committed result.")
JSON = typer.Option(False, "--json", help="Print JSON instead of text.")


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """What one command came to: committed events, or the refusal that was recorded instead."""

    command: str
    refused: bool
    reason: str = ""
    detail: str = ""
    first_seq: int = 0
    last_seq: int = 0
    duplicate: bool = False
    affected_keys: int = 0
    """Keys quarantined (clear) or evicted (release)."""
    released_jobs: int = 0
    """Fenced jobs let go (`kvledger jobs release`)."""


class Target(msgspec.Struct, frozen=True, kw_only=True):
    log_url: str | None
    socket_path: str | None
    tcp: tuple[str, int] | None
    token: str

    @property
    def via_sidecar(self) -> bool:
        return self.socket_path is not None or self.tcp is not None


def target_of(log_url: str | None, socket_path: str | None, tcp: str | None, token: str) -> Target:
    """Through the sidecar named by --socket or --tcp; else on the log named by --log; else
    through a sidecar that answers on the default socket; else on the default log. (gc reads its
    inventory from the log whichever records.)"""

    address = host_port(tcp, "--tcp")
    if socket_path is not None and address is not None:
        raise typer.BadParameter("give one of --socket and --tcp", param_hint="--socket")
    if address is not None and not token:
        raise typer.BadParameter("a sidecar on TCP needs its --token (or KVLEDGER_TOKEN)", param_hint="--token")
    if socket_path is None and address is None and log_url is None:
        default = data_dir() / "kvledger.sock"
        if default.exists() and anyio.run(sidecar_answers, str(default)):
            socket_path = str(default)
    return Target(log_url=log_url, socket_path=socket_path, tcp=address, token=token)


class RecordError(Exception):
    """The command could not be recorded (no sidecar, no log, a sidecar behind the log)."""


Summary = Callable[[AnyCommand, Sequence[Event], int, int, bool], "Recorded"]


async def record(target: Target, commands: Sequence[AnyCommand], command_ids: Sequence[str], summary: Summary) -> list[Recorded]:
    """Record each command in order and say what it came to (`summary`: what the command's
    committed events mean, or RecordError when they hold no such outcome)."""
    if target.via_sidecar:
        return await _through_sidecar(target, commands, command_ids, summary)
    return await _on_the_log(target.log_url, commands, command_ids, summary)


async def _through_sidecar(
    target: Target, commands: Sequence[AnyCommand], command_ids: Sequence[str], summary: Summary
) -> list[Recorded]:

    address = (
        Address(socket_path=target.socket_path, token=target.token)
        if target.socket_path
        else Address(tcp=target.tcp, token=target.token)
    )
    client = OperatorClient(address, retry_for=10.0)
    recorded = []
    for command, command_id in zip(commands, command_ids, strict=True):
        try:
            committed = await client.execute(command, command_id=command_id)
        except (SidecarError, SidecarUnavailable, OSError) as error:
            raise RecordError(f"the sidecar at {address} did not record it: {error}") from error
        recorded.append(summary(command, list(committed.events), committed.first_seq, committed.last_seq, committed.duplicate))
    return recorded


async def _on_the_log(
    log_url: str | None, commands: Sequence[AnyCommand], command_ids: Sequence[str], summary: Summary
) -> list[Recorded]:

    default = data_dir() / "kvledger.sock"
    if default.exists() and await sidecar_answers(str(default)):
        raise RecordError(
            f"a sidecar answers on {default}: record through it with --socket {default} (appending to its log "
            "behind its back would fork its state from the log)"
        )
    # A decision names namespaces the log already holds: a mistyped --log must not create a new,
    # empty log (where the decision would only be refused), so a missing SQLite file is an error.
    event_log = await open_existing(log_url)
    try:
        ledger = await Ledger.open(event_log)
        recorded = []
        for command, command_id in zip(commands, command_ids, strict=True):
            # Scoped as the sidecar scopes an operator's ids ("/<id>"): a retry through either
            # path finds the first one's result.
            commit = await ledger.execute(command, command_id=f"/{command_id}")
            recorded.append(summary(command, commit.events, commit.first_seq, commit.last_seq, commit.duplicate))
        return recorded
    finally:
        await event_log.close()


T = TypeVar("T")


def run(command: str, main: Callable[[], Awaitable[T]], group: str = "namespace") -> T:
    """Run `main`; a log or recording error ends with one line and exit code 1. Logs below
    warning are dropped and the rest go to stderr, so stdout holds the answer (--json) alone;
    the logging configuration is restored after (the CLI may run inside another program)."""

    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    try:
        return anyio.run(main)
    except (RecordError, LogError) as error:
        typer.echo(f"kvledger {group} {command}: {error}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        structlog.configure(**saved)
