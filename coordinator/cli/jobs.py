"""`kvledger jobs release`: an operator's word that a rank's worker of an engine is gone.

A job fenced by an engine's restart keeps what it holds (its source or destination slots
draining, its reserved tier slots, its leases) until every rank it has not heard from reports,
because a transfer that rank started may still land (I16). A worker that died with its pod never
reports: its fenced jobs would hold those slots forever. When the operator knows the worker's
process is gone (the pod was deleted, the node drained: nothing it started can land any more),
this records that, and the jobs let go as if the rank had reported:

    kvledger jobs release --engine pod-a --rank 1 --reason "pod-a-7f9 deleted at 12:03, node drained"

Recorded through the sidecar (--socket/--tcp, or the default socket when one answers) or on the
log when no sidecar serves it (--log), like `kvledger namespace`. Refused (exit 1) when no fenced
job of that engine waits on that rank: a mistyped engine or rank is not recorded as a release.
`kvledger audit block` then shows the job "released" with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import typer
import uuid_utils

from coordinator.cli._operator import COMMAND_ID, JSON, LOG, SOCKET, TCP, TOKEN, Recorded, RecordError, record, run, target_of
from coordinator.core.commands import AnyCommand, ReleaseFencedRank
from events import Event, FencedRankReleased, Refused

jobs_app = typer.Typer(help="Operator actions on jobs: release a dead worker's rank of fenced jobs.", no_args_is_help=True)


def _released(command: AnyCommand, events: Sequence[Event], first_seq: int, last_seq: int, duplicate: bool) -> Recorded:
    refused = next((e for e in events if isinstance(e, Refused)), None)
    if refused is not None:
        return Recorded(
            command="release_fenced_rank",
            refused=True,
            reason=str(refused.reason),
            detail=refused.detail,
            first_seq=first_seq,
            last_seq=last_seq,
            duplicate=duplicate,
        )
    released = next((e for e in events if isinstance(e, FencedRankReleased)), None)
    if released is None:
        raise RecordError(f"release_fenced_rank committed no release: {[type(e).__name__ for e in events]}")
    return Recorded(
        command="release_fenced_rank",
        refused=False,
        first_seq=first_seq,
        last_seq=last_seq,
        duplicate=duplicate,
        released_jobs=len(released.job_ids),
    )


@jobs_app.command("release")
def release(
    engine: str = typer.Option(..., "--engine", help="The engine whose fenced jobs wait on the rank."),
    rank: int = typer.Option(..., "--rank", help="The rank whose worker is gone."),
    reason: str = typer.Option(..., "--reason", help="Why you know it is gone: the audit record of this release."),
    log_url: str | None = LOG,
    socket_path: str | None = SOCKET,
    tcp: str | None = TCP,
    token: str = TOKEN,
    command_id: str | None = COMMAND_ID,
    json_output: bool = JSON,
) -> None:
    """Release one rank of an engine's fenced jobs: its worker is gone, so what they hold goes (I16)."""
    target = target_of(log_url, socket_path, tcp, token)
    command = ReleaseFencedRank(engine_id=engine, rank=rank, reason=reason)

    async def main() -> list[Recorded]:
        return await record(target, [command], [command_id or uuid_utils.uuid7().hex], _released)

    [recorded] = run("release", main, group="jobs")
    if json_output:
        typer.echo(msgspec.json.encode(recorded).decode())
    elif not recorded.refused:
        again = " (already recorded: this command id was committed before)" if recorded.duplicate else ""
        typer.echo(
            f"released rank {rank} of {engine}: {recorded.released_jobs} fenced jobs let go, "
            f"at seq {recorded.first_seq}..{recorded.last_seq}{again}"
        )
    if recorded.refused:
        typer.echo(f"kvledger jobs release: refused ({recorded.reason}): {recorded.detail}", err=True)
        raise typer.Exit(code=1)
