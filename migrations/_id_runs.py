"""Writing every kvl_id_runs row's ids back as kvl_event_ids rows, as an append before runs
wrote them: the downgrades of 0009 (SQLite's runs) and 0010 (PostgreSQL's) share it."""

from __future__ import annotations

import sqlalchemy as sa

from events.log._step_rows import stored_step

_STEP_OF_RUN = sa.text(
    "SELECT r.first_id, s.first_seq, s.last_seq, s.stream_id, s.first_version, s.schemas, s.header, s.payload, s.step, "
    "s.recorded_at, s.codec FROM kvl_id_runs AS r JOIN kvl_steps AS s ON s.first_seq = r.first_seq "
    "WHERE :after IS NULL OR r.first_id > :after ORDER BY r.first_id LIMIT 1000"
).bindparams(sa.bindparam("after", type_=sa.String))


def runs_back_to_rows(bind: sa.Connection) -> None:
    """Each run's ids become a kvl_event_ids row each (read from its step's header, a page of
    1,000 runs at a time), and the runs are deleted."""
    ids = sa.table("kvl_event_ids", sa.column("event_id"), sa.column("global_seq"))
    after: str | None = None
    while True:
        page = bind.execute(_STEP_OF_RUN, {"after": after}).all()
        if not page:
            break
        steps = [stored_step(row[1:]) for row in page]
        rows = [
            {"event_id": event_id, "global_seq": step.first_seq + index}
            for step in steps
            for index, event_id in enumerate(step.event_ids())
        ]
        bind.execute(ids.insert(), rows)
        after = page[-1][0]
    bind.execute(sa.text("DELETE FROM kvl_id_runs"))
