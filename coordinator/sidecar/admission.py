"""Admission: what the sidecar checks of a request before the ledger decides it. Pure: values
in, values out; server.py calls these and sends what they answer.

Two rules, each broken by an input found while fuzzing the protocol (tests/sidecar/test_fuzz_protocol.py
names each one):

* a connection speaks only for its own engine (I9): a command naming another engine, an
  operator's command, a report on another engine's job are refused whole;
* nothing reaches the log that its columns cannot hold (events/log/schema.py): an id too long
  or a number too large used to fail the append of a whole group commit (every other engine's
  transaction in it too) and make the ledger rebuild, or, past the append, to stop the audit
  index from catching up for good.

A refused request is an `Error` (INVALID_MESSAGE or WRONG_ROLE) and nothing of it is committed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from coordinator.core import checks as check_limits
from coordinator.core.commands import (
    OPERATOR_COMMANDS,
    AnyCommand,
    BeginStep,
    DeclareEngine,
    DeclareTier,
    EndStep,
    ReportRank,
    StartOwner,
)
from coordinator.core.decider import decide
from coordinator.core.state import State, TierState
from coordinator.ledger.ledger import Commit, StepCommit
from coordinator.sidecar import protocol as p
from events import Event, RankReported, Refused, StepBegan, TierSpec

MAX_LOGGED_COMMAND_ID = 128
"""Characters of the log's command id column (kvl_commands.command_id; see `scoped`)."""
MAX_POOL_ID = check_limits.MAX_POOL_ID
MAX_COMMANDS_PER_STEP = p.MAX_COMMANDS
"""Commands in one Step or reports in one Reports (the benchmarks' steps hold 256; vLLM's pass
holds a load or a store per request, and LedgerSession splits a pass that holds more). A step is
decided whole, on the event loop, at ~20-25 us a command: one of 16,384 held every other
engine's steps for ~390 ms (ops/bench/hostile.py); one of 512 held them ~10 ms, and pushed a
small step's p99 under attack to 3x its p99 alone, so it is 256."""
TOLD_CHARS = 2000
"""A bound on what one error tells the client; the log's own errors (LogDiverged names the topic, its URL and
the offsets) fit whole."""


def told(error: BaseException) -> str:
    """What a client is told of a failed commit: the error's type and first line, without the
    SQL statement and parameters a driver error carries (those stay in the sidecar's own log)."""
    text = str(error)
    for cut in ("\n[SQL:", "\n(Background on this error", "[SQL:"):
        text = text.split(cut, 1)[0]
    text = " ".join(text.split())
    if len(text) > TOLD_CHARS:
        text = text[: TOLD_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


"""The largest pool id the audit index holds (see `declaration_problem`)."""


def scoped(engine_id: str, kind: str, command_id: str) -> str:
    """The log's id for a client's command id. Command ids are the client's; the log's are unique
    per engine and per kind of message ("step", "execute", "report"): one engine's retry can never
    be answered with another engine's committed events (I9), nor a report with a step's. The
    engine id's length is spelled out, so no engine id (they may hold "/") can forge another's
    scope: engine "team" with id "a/s1" and engine "team/a" with id "s1" used to be one id. The
    log keeps them in a 128-character column: a longer one is kept as its digest, the same for
    every retry (PostgreSQL refused it at the append, failing the whole group), and so is one
    holding a NUL, which PostgreSQL's text cannot hold (session 31)."""
    scoped_id = f"{kind}:{len(engine_id)}:{engine_id}/{command_id}"
    if len(scoped_id) <= MAX_LOGGED_COMMAND_ID and "\x00" not in scoped_id:
        return scoped_id
    return "sha256:" + hashlib.sha256(scoped_id.encode()).hexdigest()


def foreign(engine_id: str, commands: Sequence[AnyCommand]) -> p.Error | None:
    """An engine speaks only for itself: a command naming another engine is refused whole, and so
    is an operator's command (a namespace decision may touch other engines' keys), a command that
    opens or closes a step, and a declaration the log could not hold (`declaration_problem`)."""
    for index, command in enumerate(commands):
        if isinstance(command, (BeginStep, EndStep)):
            # The sidecar frames every step itself: one append could hold two steps, an Execute
            # open a step spanning appends, a retried step answer with fewer events than its first.
            return p.Error(
                code=p.ErrorCode.INVALID_MESSAGE,
                message=f"command {index} ({type(command).__name__}) controls the step: a Step's "
                "commands are framed by the sidecar (its step and clock are the Step's own)",
            )
        if isinstance(command, OPERATOR_COMMANDS):
            return p.Error(
                code=p.ErrorCode.WRONG_ROLE,
                message=f"command {index} ({type(command).__name__}) is an operator's: send it on an operator connection",
            )
        named = getattr(command, "engine_id", engine_id)
        if named != engine_id:
            return p.Error(
                code=p.ErrorCode.INVALID_MESSAGE,
                message=f"command {index} names engine {named!r}; this connection is engine {engine_id!r}",
            )
        problem = declaration_problem(command) if isinstance(command, DeclareEngine) else None
        if problem is not None:
            return p.Error(code=p.ErrorCode.INVALID_MESSAGE, message=f"command {index}: {problem}")
    return None


def attributed(engine_id: str, commands: Sequence[AnyCommand]) -> list[AnyCommand]:
    """The commands with each ReportRank attributed to this connection's engine: one that names no
    engine gets this one (a client need not send it), so the decider refuses it on another
    engine's job (FOREIGN_JOB) whatever happened between this door and its decision; one that
    names another engine is left as it is, for `foreign` to refuse."""
    return [
        msgspec.structs.replace(command, engine_id=engine_id)
        if isinstance(command, ReportRank) and not command.engine_id
        else command
        for command in commands
    ]


def foreign_commands(state: State, engine_id: str, commands: Sequence[AnyCommand]) -> p.Error | None:
    """`foreign`, and a ReportRank among the commands of an Execute or a Step on another engine's
    job (`foreign_report`): found by tests/sidecar/test_fuzz_protocol.py, an engine's Execute of a
    ReportRank failed the other engine's store job (only a Report was checked)."""
    reports = (foreign_report(state, engine_id, command) for command in commands if isinstance(command, ReportRank))
    return foreign(engine_id, commands) or next((problem for problem in reports if problem is not None), None)


def foreign_report(state: State, engine_id: str, report: ReportRank, rank: int | None = None) -> p.Error | None:
    """A report on another engine's job, refused at the door: another engine's worker completed
    this engine's store job, publishing its keys with checksums of bytes it never wrote (I9, I13).
    A report naming another engine than the connection's is refused too. A job that ended is left
    to the decider (it drops the notice). A job not made yet (at or past the state's next job id)
    is refused: it may be made by another engine's step in the very group this report would be
    decided in, after this check (a hostile engine guessing the next id), and a worker reports
    only jobs it was sent, committed. The decider checks the job's engine again when it decides
    (the report is `attributed`), against the state then. A worker's connection (`rank`: the rank
    its Hello named) reports for its own rank only: a rank-0 worker that reported rank 1 too
    completed a two-rank store alone, publishing a checksum for a shard no rank-1 worker wrote
    (I5; an adversarial review, session 31)."""
    if rank is not None and report.rank != rank:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"the report is of rank {report.rank}; this connection is worker rank {rank} of engine {engine_id!r}",
        )
    if report.engine_id and report.engine_id != engine_id:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"the report names engine {report.engine_id!r}; this connection is engine {engine_id!r}",
        )
    if report.job_id >= state.next_job_id:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"job {report.job_id} does not exist (the next job is {state.next_job_id}): report only jobs you were sent",
        )
    fenced = state.fenced.get(report.job_id)
    job = state.jobs.get(report.job_id) or (fenced.job if fenced is not None else None)
    if job is None or job.decision.engine_id == engine_id:
        return None
    return p.Error(
        code=p.ErrorCode.INVALID_MESSAGE,
        message=f"job {report.job_id} belongs to engine {job.decision.engine_id!r}, not to this "
        f"connection's engine {engine_id!r}",
    )


def declaration_problem(declare: DeclareEngine) -> str | None:
    """What of a declaration the log's audit index could not hold. Its pool column is a 32-bit
    INTEGER (kvl_audit_slots.pool), and the audit API asks for pools 0..MAX_POOL_ID: an engine
    declared with pool 2**31 (PostgreSQL) or 2**63 (SQLite) made every catch-up of the index fail
    from its first allocation on, so every audit query answered 503. The decider does not bound
    pool ids; the sidecar, every engine's door, does."""
    for pool in declare.pools:
        if not 0 <= pool.pool_id <= MAX_POOL_ID:
            return f"pool id {pool.pool_id} is outside 0..{MAX_POOL_ID}"
    return None


MAX_TIER_SLOTS = 1 << 22
"""Tier slots a sidecar holds for all its tiers together, by default (`serve --max-tier-slots`):
about 150 B of state each, so ~600 MiB. Any engine connection could declare tiers of up to 2**24
slots, as many as it liked: one 80-byte message added ~1.3 GB of RSS, and it is in the log, so
every restart rebuilt it (issue 17)."""
MAX_TIERS = 64
"""Tiers a sidecar holds, by default (`serve --max-tiers`)."""
MAX_POOL_BLOCKS = 1 << 23
"""Blocks all engines' pools hold together, by default (`serve --max-pool-blocks`): ~100 B of state
each (measured), ~830 MiB (a large vLLM engine has ~10^5 blocks). One declaration could ask for 64 pools of
2**24 blocks."""
MAX_OWNERS_PER_ENGINE = 1 << 16
"""Live owners (requests started, not finished) one engine may hold (`serve --max-owners-per-engine`)."""


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """What engines may make the sidecar hold (`kvledger serve --max-...`): each bounds state that
    lives until its engine lets it go, and that a restart rebuilds from the log."""

    tier_slots: int = MAX_TIER_SLOTS
    tiers: int = MAX_TIERS
    pool_blocks: int = MAX_POOL_BLOCKS
    owners_per_engine: int = MAX_OWNERS_PER_ENGINE


_BUDGETED = (DeclareTier, DeclareEngine, StartOwner)


def over_budget(state: State, engine_id: str, commands: Sequence[AnyCommand], budget: Budget) -> p.Error | None:
    """What an engine's message (its Hello's declarations, a Step, an Execute) would hold beyond
    the sidecar's budget: refused whole, naming the budget and the option that raises it."""
    if not any(isinstance(command, _BUDGETED) for command in commands):
        return None
    return (
        over_tier_budget(state, commands, budget)
        or over_pool_budget(state, commands, budget)
        or over_owner_budget(state, engine_id, commands, budget)
    )


def over_tier_budget(state: State, commands: Sequence[AnyCommand], budget: Budget) -> p.Error | None:
    # A declaration the decider refuses anyway (a count out of its range) is left to it: its
    # refusal is recorded in the log (I1), where this one is not.
    new = {
        command.spec.name: command.spec
        for command in commands
        if isinstance(command, DeclareTier)
        and command.spec.name not in state.tiers
        and 0 < command.spec.num_slots <= check_limits.MAX_BLOCKS_PER_POOL
    }
    if not new:
        return None
    held = sum(tier.spec.num_slots for tier in state.tiers.values())
    wanted = sum(spec.num_slots for spec in new.values())
    if len(state.tiers) + len(new) > budget.tiers:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"declaring {sorted(new)} would make {len(state.tiers) + len(new)} tiers; this sidecar "
            f"holds at most {budget.tiers} (raise it with `kvledger serve --max-tiers`)",
        )
    if held + wanted > budget.tier_slots:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"declaring {sorted(new)} ({wanted:,} slots) would make {held + wanted:,} tier slots; "
            f"this sidecar holds at most {budget.tier_slots:,} (raise it with `kvledger serve --max-tier-slots`)",
        )
    return None


def over_pool_budget(state: State, commands: Sequence[AnyCommand], budget: Budget) -> p.Error | None:
    """A new engine's pools beyond the blocks all engines' pools may hold together (a known
    engine declared again keeps its pools: the decider refuses another layout)."""
    new = {
        command.engine_id: sum(max(pool.num_blocks, 0) for pool in command.pools)
        for command in commands
        if isinstance(command, DeclareEngine) and command.engine_id not in state.engines
    }
    if not new:
        return None
    held = sum(pool.spec.num_blocks for engine in state.engines.values() for pool in engine.pools.values())
    wanted = sum(new.values())
    if held + wanted > budget.pool_blocks:
        return p.Error(
            code=p.ErrorCode.INVALID_MESSAGE,
            message=f"declaring engine {sorted(new)[0]!r} ({wanted:,} pool blocks) would make {held + wanted:,} "
            f"blocks in all engines' pools; this sidecar holds at most {budget.pool_blocks:,} "
            f"(raise it with `kvledger serve --max-pool-blocks`)",
        )
    return None


def over_owner_budget(state: State, engine_id: str, commands: Sequence[AnyCommand], budget: Budget) -> p.Error | None:
    """Owners (requests) an engine starts beyond the live owners it may hold: each is ~500 B until
    it is finished (295k never finished added ~140 MB, issue 17)."""
    starting = sum(1 for command in commands if isinstance(command, StartOwner))
    if not starting or len(state.owners) + starting <= budget.owners_per_engine:
        return None  # the fast path: fewer owners in all than one engine may hold
    live = sum(1 for owner in state.owners.values() if owner.engine_id == engine_id)
    if live + starting <= budget.owners_per_engine:
        return None
    return p.Error(
        code=p.ErrorCode.INVALID_MESSAGE,
        message=f"engine {engine_id!r} holds {live:,} live owners; starting {starting:,} more would pass the "
        f"{budget.owners_per_engine:,} an engine may hold (finish owners, or raise it with "
        f"`kvledger serve --max-owners-per-engine`)",
    )


def tier_conflict(tiers: Sequence[TierSpec]) -> str | None:
    """A Hello naming one tier twice with two specs (no state could take both)."""
    specs: dict[str, TierSpec] = {}
    for spec in tiers:
        if specs.setdefault(spec.name, spec) != spec:
            return f"the Hello declares tier {spec.name!r} twice, differently"
    return None


def refused_declaration(state: State, declarations: Sequence[AnyCommand]) -> AnyCommand | None:
    """The first of a Hello's declarations the decider refuses, each decided (pure: nothing is
    folded) against `state` plus the Hello's tiers, which agree with each other (`tier_conflict`):
    committed alone, it is refused again, for the record (I1). A Hello is taken whole or not at
    all: a refused declaration used to leave the tiers before it declared."""
    tiers = dict(state.tiers)
    for command in declarations:
        view = msgspec.structs.replace(state, tiers=tiers)  # shallow: the decider only reads
        if any(isinstance(event, Refused) for event in decide(view, command)):
            return command
        if isinstance(command, DeclareTier) and command.spec.name not in tiers:
            # What the decider reads of a tier to come is its spec: its slots are not made.
            tiers[command.spec.name] = TierState.declared(command.spec)
    return None


def reused_for_other_content(commit: Commit, command_id: str, kind: str) -> p.Error | None:
    """A command id committed with other content (the ledger compares their digests): answering
    with the first content's events told the client its own was in the log."""
    if not commit.reused:
        return None
    return p.Error(
        code=p.ErrorCode.COMMAND_ID_REUSED,
        message=f"command id {command_id!r} was committed for another {kind} (other content): a retry sends "
        f"the same {kind}; a new {kind} needs a new command id",
    )


def retried_as_another_step(result: StepCommit, message: p.Step) -> p.Error | None:
    """A command id committed for step M (at clock C), sent again with step N or another clock:
    answering with step M's events as StepResult(step=N, duplicate=True) told the engine its step
    N was in the log. Refused `command_id_reused`."""
    began = next((event for event in result.began if isinstance(event, StepBegan)), None)
    if not result.commit.duplicate or began is None or (began.step, began.clock) == (message.step, message.clock):
        return None
    return p.Error(
        code=p.ErrorCode.COMMAND_ID_REUSED,
        message=f"command id {message.command_id!r} was committed for step {began.step} at clock "
        f"{began.clock}, not step {message.step} at {message.clock}: a retry sends the same step; "
        f"a new step needs a new command id",
    )


def reused_for_another_report(events: Sequence[Event], report: ReportRank, command_id: str) -> p.Error | None:
    """A report's command id answered with what another report committed (another job or rank)."""
    for event in events:
        if isinstance(event, RankReported) and (event.job_id, event.rank) != (report.job_id, report.rank):
            return p.Error(
                code=p.ErrorCode.COMMAND_ID_REUSED,
                message=f"command id {command_id!r} was committed for job {event.job_id} rank {event.rank}, "
                f"not job {report.job_id} rank {report.rank}: a new report needs a new command id",
            )
    return None
