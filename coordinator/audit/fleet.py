"""`kvledger fleet`: the fleet audit service. It reads every engine's stream from a Kafka log's
topic and keeps the audit index (kvl_audit_*) of the whole fleet in one SQL database, so that
`kvledger audit ... --log kafka://HOST:PORT/TOPIC?state=<that database>` and the HTTP audit API
answer for every engine.

Where it writes. `--db` becomes the Kafka log's state store (the `?state=` of its URL): the audit
index, its "audit" checkpoint and the store's own checkpoints live there, and nothing else is
written anywhere (the topic is only read). PostgreSQL is the fleet's database; a SQLite file works
too (one machine, tests).

Exactly once. The position in the topic is the audit checkpoint itself: a global sequence, which
every reader of the topic assigns alike (events/log/_kafka_fold.py). Each batch of index rows is
inserted in the same transaction as the checkpoint that follows it (coordinator/audit/store.py,
`sync_index`), so whatever stops the service (SIGTERM, a crash, a lost broker, a cancelled batch)
the index holds each event's rows once, and a restart goes on from the checkpoint. No Kafka
consumer group and no Kafka offsets are committed anywhere.

Tailing. It catches up with the topic in batches, then asks the topic for its head every
`--poll` seconds and indexes what came. SIGTERM or SIGINT stops it between batches (a second one
stops it at once: the batch in flight rolls back).

Outages. While the broker is unreachable it reopens the log with a backoff; while the audit
database is unreachable (a connection refused or dropped: `database_outage`) likewise, the batch
in flight having rolled back with its checkpoint. A topic that went backwards (LogDiverged), or
a database that refuses what it is asked (a schema problem), ends it with the reason, exit 1.

HTTP (`--http HOST:PORT`, coordinator/audit/fleet_http.py): the audit API under /audit/ for the whole
fleet (tokens from `--audit-tokens`, as the sidecar's), /healthz, /readyz (503 with the reason
during an outage) and /metrics (indexed sequence, head, lag, outages).

Forensics never creates a log: the topic must exist (`require_topic`), and a missing one is an
error rather than a new, empty topic.
"""

from __future__ import annotations

import signal
import time
import urllib.parse
from collections.abc import Callable

import anyio
import sqlalchemy as sa
import structlog

from coordinator.audit.api import Tokens
from coordinator.audit.fleet_http import FleetHealth, fleet_app
from coordinator.audit.store import IndexProgress, indexed_seq, sync_index
from coordinator.http_serving import listen, serve_http
from events.log import LogError, LogUnavailable, SqlEventLog, is_kafka, is_outage, mask
from events.log.kafka_target import one_line, parse_kafka_url
from events.log.opening import check_state_store, open_fleet_log, shown_target

log = structlog.get_logger("kvledger.fleet")

DEFAULT_BATCH = 10_000
DEFAULT_POLL_S = 0.5
RETRY_MAX_S = 30.0


class FleetError(ValueError):
    """Bad input (exit code 2): what is wrong, in one line."""


def fleet_url(log_url: str | None, db: str | None) -> str:
    """The Kafka log URL with `db` as its state store (the audit index's database).

    Raises FleetError for a log that is not kafka://, a --db that is neither PostgreSQL nor
    SQLite, no database at all, or a `?state=` in the URL that names another database than --db."""
    if not log_url or not is_kafka(log_url):
        shown = "nothing" if not log_url else repr(mask(log_url) if "://" in log_url else log_url)
        raise FleetError(f"--log must be a Kafka log, kafka://HOST:PORT/TOPIC; got {shown}")
    try:
        parse_kafka_url(log_url)
    except ValueError as error:
        raise FleetError(str(error)) from None
    parts = urllib.parse.urlsplit(log_url)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    given = query.get("state", [None])[-1]
    if db is None:
        if given is None:
            raise FleetError("name the audit index's database with --db postgresql://... (or ?state= in the --log URL)")
        db = given
    elif given is not None and given != db:
        raise FleetError(f"--db {mask(db)!r} and the --log URL's ?state={mask(given)!r} name different databases")
    try:
        check_state_store(db, "--db")
    except ValueError as error:
        raise FleetError(str(error)) from None
    query["state"] = [db]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, doseq=True)))


class FleetProgress(IndexProgress, frozen=True):
    events_per_s: float


def database_outage(error: BaseException) -> bool:
    """Whether `error` says the audit database is unreachable or dropped the connection (retry),
    rather than refused what was asked of it (a bug or a schema problem: stop)."""
    return is_outage(error)


async def run_fleet(
    url: str,
    *,
    stop: anyio.Event,
    batch: int = DEFAULT_BATCH,
    poll_s: float = DEFAULT_POLL_S,
    on_progress: Callable[[IndexProgress], None] | None = None,
    until_idle: bool = False,
    health: FleetHealth | None = None,
) -> int:
    """Index the Kafka log at `url` (state store included, see fleet_url) into its state store
    until `stop` is set (between batches), or with `until_idle` until it has caught up; returns
    the indexed sequence. Raises LogError when it cannot open the log the first time, or when the
    log failed closed (LogDiverged and the like); while the broker or the audit database is down
    it retries, and `health` (the HTTP side's view) says so."""
    target = parse_kafka_url(url)
    shown = shown_target(target)
    state = mask(target.state_url)
    health = health if health is not None else FleetHealth()
    event_log: SqlEventLog | None = await open_fleet_log(url)
    retry_s = 1.0
    done = 0
    try:
        assert event_log is not None
        done = await indexed_seq(event_log)
        health.serving(event_log)
        health.progressed(done, done)
        log.info("fleet_started", log=shown, db=state, indexed_seq=done, batch=batch)
        caught_up = False
        while not stop.is_set():
            try:
                if event_log is None:
                    event_log = await open_fleet_log(url)
                    done = await indexed_seq(event_log)
                    health.serving(event_log)
                    log.info("fleet_log_reopened", log=shown, indexed_seq=done)
                    retry_s = 1.0
                head = await event_log.head()
                health.progressed(done, head)
                if head > done:
                    caught_up = False
                    started, first = time.monotonic(), done
                    rows: list[IndexProgress] = []
                    done = await sync_index(event_log, until_seq=min(head, done + batch), batch=batch, on_progress=rows.append)
                    elapsed = time.monotonic() - started
                    health.progressed(done, head)
                    rate = (done - first) / elapsed if elapsed > 0 else 0.0
                    progress = FleetProgress(done, head, sum(r.rows for r in rows[-1:]), rate)
                    log.info(
                        "fleet_indexed",
                        indexed_seq=done,
                        head=head,
                        behind=max(head - done, 0),
                        rows=progress.rows,
                        events_per_s=round(rate),
                    )
                    if on_progress is not None:
                        on_progress(progress)
                    continue
                if caught_up:
                    await indexed_seq(event_log)  # idle: a look at the database, so readiness sees an outage
                else:
                    caught_up = True
                    log.info("fleet_caught_up", indexed_seq=done, head=head)
                if until_idle:
                    break
                with anyio.move_on_after(poll_s):
                    await stop.wait()
            except (LogUnavailable, sa.exc.SQLAlchemyError, OSError, TimeoutError) as error:
                if isinstance(error, LogUnavailable):
                    # The broker went away (the log fails closed on any fetch error): reopen it.
                    health.failed("log", f"the log is unavailable: {error}")
                    log.warning("fleet_log_unavailable", log=shown, error=str(error), retry_in_s=retry_s)
                elif database_outage(error):
                    # The audit database went away: the batch in flight rolled back; reopen.
                    health.failed("database", f"the audit database failed: {one_line(error)}")
                    log.warning("fleet_db_unavailable", db=state, error=one_line(error), retry_in_s=retry_s)
                else:
                    raise
                if event_log is not None:
                    await _close_quietly(event_log)
                    event_log = None
                with anyio.move_on_after(retry_s):
                    await stop.wait()
                retry_s = min(retry_s * 2, RETRY_MAX_S)
    finally:
        health.stopping()
        if event_log is not None:
            await _close_quietly(event_log)
    log.info("fleet_stopped", log=shown, indexed_seq=done)
    return done


async def _close_quietly(event_log: SqlEventLog) -> None:
    """Close the log whatever the outage left of it: the index's rows and checkpoint are already
    committed together or not at all, so a failed close loses nothing."""
    with anyio.CancelScope(shield=True):
        try:
            await event_log.close()
        except (sa.exc.SQLAlchemyError, LogError, OSError, TimeoutError) as error:
            log.warning("fleet_close_failed", error=one_line(error))


async def serve_fleet(
    url: str, batch: int, poll_s: float, http: tuple[str, int] | None = None, tokens: Tokens | None = None
) -> int:
    """run_fleet until SIGTERM or SIGINT (the first stops after the batch in flight, a second at
    once), with the HTTP side on `http` if given."""
    stop = anyio.Event()
    health = FleetHealth()
    async with anyio.create_task_group() as tasks:
        if http is not None:
            await tasks.start(_serve_http, health, tokens, http)

        async def signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for signum in received:
                    if stop.is_set():
                        log.warning("fleet_stopping_now", signal=signal.Signals(signum).name)
                        tasks.cancel_scope.cancel()
                        return
                    log.info("fleet_stopping", signal=signal.Signals(signum).name)
                    stop.set()

        tasks.start_soon(signals)
        try:
            done = await run_fleet(url, stop=stop, batch=batch, poll_s=poll_s, health=health)
        except Exception as error:  # noqa: BLE001 - raised below, outside the task group (no ExceptionGroup)
            failed: Exception | None = error
        else:
            failed = None
        tasks.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return done


async def _serve_http(
    health: FleetHealth,
    tokens: Tokens | None,
    address: tuple[str, int],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    host, port = address
    try:
        sock = listen(host, port)
    except OSError as error:
        raise FleetError(f"--http {host}:{port}: cannot listen there: {error.strerror or error}") from None
    bound = sock.getsockname()[:2]
    log.info("fleet_http", url=f"http://{bound[0]}:{bound[1]}", audit_tokens=tokens is not None)
    task_status.started()
    await serve_http(fleet_app(health, tokens), sock)
