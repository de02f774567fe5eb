"""`kvledger namespace ...`: namespace release decisions (seed 003), recorded as events.

`decide` records one decision from namespace A to namespace B: new, compatible (with the id of
the verification run as evidence) or clear (A's keys are quarantined). `gc` releases the
namespaces whose last use, by the audit index's inventory, is older than a duration: their keys
are evicted. Both go through the decider like any engine's command, so a bad request is a
recorded refusal and the state is what the log projects to (I18).

Where a command is recorded: through the running sidecar with --socket or --tcp (an operator
connection, coordinator.client.OperatorClient); directly on the log with --log when no sidecar
serves it (coordinator.ledger.Ledger decides and appends). Writing a log behind a sidecar's back
would fork its state from the log, so --log refuses when a sidecar answers on the default socket.
With neither, the default socket is used if a sidecar answers there, else the default log.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
import re
import time
from collections.abc import Sequence

import msgspec
import typer
import uuid_utils

from coordinator.audit.answers import AuditError
from coordinator.audit.queries import Audit
from coordinator.audit.store import sync_index
from coordinator.audit.times import read_time
from coordinator.cli._operator import COMMAND_ID, JSON, LOG, SOCKET, TCP, TOKEN, Recorded, RecordError, record, run, target_of
from coordinator.core.commands import AnyCommand, DecideNamespace, ReleaseNamespace
from events import Event, KeyEvicted, KeyQuarantined, NamespaceDecided, NamespaceReleased, Refused
from events.log.opening import open_existing

namespace_app = typer.Typer(
    help="Namespace release decisions (seed 003): new, compatible or clear; clean up abandoned namespaces.",
    no_args_is_help=True,
)


class Outcome(enum.StrEnum):
    new = "new"
    compatible = "compatible"
    clear = "clear"


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    namespace_id: str
    tenant: str
    model_id: str
    keys: int
    bytes: int
    last_used_at: float
    idle_seconds: float


class GcReport(msgspec.Struct, frozen=True, kw_only=True):
    now: float
    older_than_seconds: float
    dry_run: bool
    candidates: list[Candidate]
    released: list[Recorded] = []


# --- durations ------------------------------------------------------------------------------------

_UNITS = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 7d, 12h, 30m, 45s, 2w or 1d12h (units w, d, h, m, s; each
    part a non-negative number, the whole positive). Raises ValueError naming what is wrong."""
    compact = text.strip().lower()
    parts = _PART.findall(compact)
    if not compact or "".join(number + unit for number, unit in parts) != compact:
        raise ValueError(f"{text!r} is not a duration like 7d, 12h, 30m or 1d12h (units: w, d, h, m, s)")
    seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is too long a duration")
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def _summary(command: AnyCommand, events: Sequence[Event], first_seq: int, last_seq: int, duplicate: bool) -> Recorded:
    tag = type(command).__struct_config__.tag
    assert isinstance(tag, str)
    refused = next((e for e in events if isinstance(e, Refused)), None)
    if refused is not None:
        return Recorded(
            command=tag,
            refused=True,
            reason=str(refused.reason),
            detail=refused.detail,
            first_seq=first_seq,
            last_seq=last_seq,
            duplicate=duplicate,
        )
    affected = sum(isinstance(e, (KeyQuarantined, KeyEvicted)) for e in events)
    if not any(isinstance(e, (NamespaceDecided, NamespaceReleased)) for e in events):
        raise RecordError(f"{tag} committed no decision: {[type(e).__name__ for e in events]}")
    return Recorded(
        command=tag, refused=False, first_seq=first_seq, last_seq=last_seq, duplicate=duplicate, affected_keys=affected
    )


# --- commands -------------------------------------------------------------------------------------


@namespace_app.command("decide")
def decide(
    from_namespace: str = typer.Option(..., "--from", help="Namespace A, in hex (as `kvledger audit namespaces` lists it)."),
    to_namespace: str = typer.Option(..., "--to", help="Namespace B, in hex."),
    outcome: Outcome = typer.Option(
        ...,
        "--outcome",
        help="new: B shares nothing with A. compatible: B may treat A's keys as "
        "equivalent (needs --evidence). clear: quarantine every key of A.",
    ),
    reason: str = typer.Option(..., "--reason", help="Why: the audit record of this decision."),
    evidence: str = typer.Option(
        "",
        "--evidence",
        help="RUN_ID of the verification run that compared cached and uncached outputs (required for compatible).",
    ),
    log_url: str | None = LOG,
    socket_path: str | None = SOCKET,
    tcp: str | None = TCP,
    token: str = TOKEN,
    command_id: str | None = COMMAND_ID,
    json_output: bool = JSON,
) -> None:
    """Record a release decision from namespace A to namespace B (seed 003)."""
    target = target_of(log_url, socket_path, tcp, token)
    command = DecideNamespace(
        from_namespace=from_namespace, to_namespace=to_namespace, outcome=outcome.value, reason=reason, evidence=evidence
    )

    async def main() -> list[Recorded]:
        return await record(target, [command], [command_id or uuid_utils.uuid7().hex], _summary)

    [recorded] = run("decide", main)
    if json_output:
        typer.echo(msgspec.json.encode(recorded).decode())
    elif not recorded.refused:
        cleared = f"; {recorded.affected_keys} keys of {from_namespace} quarantined" if outcome is Outcome.clear else ""
        again = " (already recorded: this command id was committed before)" if recorded.duplicate else ""
        typer.echo(
            f"decided {outcome.value}: {from_namespace} -> {to_namespace}{cleared}, "
            f"at seq {recorded.first_seq}..{recorded.last_seq}{again}"
        )
    if recorded.refused:
        typer.echo(f"kvledger namespace decide: refused ({recorded.reason}): {recorded.detail}", err=True)
        raise typer.Exit(code=1)


@namespace_app.command("gc")
def gc(
    older_than: str = typer.Option(
        ..., "--older-than", help="Release namespaces whose last use is older than this: 7d, 12h, 30m, 1d12h..."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be released; record nothing."),
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's namespaces."),
    now: str | None = typer.Option(None, "--now", help="Judge ages at this time (ISO 8601 or epoch seconds; default: now)."),
    log_url: str | None = LOG,
    socket_path: str | None = SOCKET,
    tcp: str | None = TCP,
    token: str = TOKEN,
    command_id: str | None = COMMAND_ID,
    json_output: bool = JSON,
) -> None:
    """Release abandoned namespaces: evict every key of each namespace last used (published or
    loaded, by the audit index) longer ago than --older-than."""

    try:
        seconds = parse_duration(older_than)
        at = time.time() if now is None else read_time(now)
    except (ValueError, AuditError) as error:
        raise typer.BadParameter(str(error), param_hint="--older-than" if isinstance(error, ValueError) else "--now") from None
    target = target_of(log_url, socket_path, tcp, token)
    batch = command_id or uuid_utils.uuid7().hex

    async def main() -> GcReport:
        event_log = await open_existing(log_url)  # never a new, empty log: a mistyped --log is an error
        try:
            await sync_index(event_log)
            inventory = await Audit(event_log, tenant=tenant).namespaces(now=at)
        finally:
            await event_log.close()
        candidates = [
            Candidate(
                namespace_id=e.namespace_id,
                tenant=e.tenant,
                model_id=e.model_id,
                keys=e.keys,
                bytes=e.bytes,
                last_used_at=e.last_used_at,
                idle_seconds=at - e.last_used_at,
            )
            for e in inventory
            # A namespace with no live key has nothing to release (a released one stays so).
            if e.keys > 0 and e.last_used_at is not None and at - e.last_used_at > seconds
        ]
        if dry_run or not candidates:
            return GcReport(now=at, older_than_seconds=seconds, dry_run=dry_run, candidates=candidates)
        commands: list[AnyCommand] = [
            ReleaseNamespace(
                namespace=c.namespace_id,
                reason=f"kvledger namespace gc: last used {_iso(c.last_used_at)}, older than {older_than}",
            )
            for c in candidates
        ]
        released = await record(target, commands, [f"{batch}/{c.namespace_id}" for c in candidates], _summary)
        return GcReport(now=at, older_than_seconds=seconds, dry_run=False, candidates=candidates, released=released)

    report = run("gc", main)
    if json_output:
        typer.echo(msgspec.json.encode(report).decode())
    else:
        verb = "would release" if dry_run else "released"
        typer.echo(f"{len(report.candidates)} namespaces last used more than {older_than} before {_iso(at)}")
        outcomes: list[Recorded | None] = list(report.released) if report.released else [None] * len(report.candidates)
        for candidate, outcome in zip(report.candidates, outcomes, strict=True):
            line = (
                f"{candidate.namespace_id} tenant {candidate.tenant} model {candidate.model_id}: {candidate.keys} keys, "
                f"{candidate.bytes:,} bytes, last used {_iso(candidate.last_used_at)}"
            )
            if outcome is None:
                typer.echo(f"{verb} {line}")
            elif outcome.refused:
                typer.echo(f"REFUSED {line}: {outcome.reason}: {outcome.detail}")
            else:
                typer.echo(f"released {line}: {outcome.affected_keys} keys evicted")
    if any(r.refused for r in report.released):
        raise typer.Exit(code=1)


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="seconds")
