"""Validation shared by the decider's handlers. Each check raises `Refusal` with a reason."""

from __future__ import annotations

import math
import re

from coordinator.core.state import EngineState, OwnerState, PoolState, State, TierState, jobs_in_flight
from events import NULL_BLOCK_ID, BlockRef, Reason

MAX_BLOCKS_PER_POOL = 1 << 24
MAX_POOL_ID = (1 << 31) - 1
"""Pool ids are 32-bit signed in the log's and the audit index's tables (kvl_audit_slots.pool)."""
MAX_ITEMS_PER_COMMAND = 1 << 16
MAX_LOOKUP_TOKENS = 1 << 18
"""Token ids one prefix lookup hashes (262,144: beyond the longest contexts served): one of 2**21,
in a 16 MiB frame, held every engine of the sidecar for 17-20 s (issue 17)."""
MAX_EXTRA_KEYS = 1 << 10
MAX_LEASE_SECONDS = 86_400.0
MAX_STEP_JUMP = 1 << 48
"""How far one step number may leap past the engine's last (~8.9 years of a microsecond wall
clock, vLLM's step numbers). Unbounded, one step numbered 2**63-1 refused every later step of
the engine (issue 17). The first step of an incarnation may be any number in 0..MAX_FIRST_STEP."""
MAX_FIRST_STEP = 1 << 53
"""The largest first step of an incarnation: a microsecond wall clock (vLLM's step numbers, ~1.8e15
now) fits until the year 2255."""
MAX_STREAM_NAME = 248
"""Characters of an engine id or a tier name: each names a stream of the log ("engine/<id>",
"tier/<name>"), a 255-character column (kvl_steps.stream_id). PostgreSQL refused a longer one at
the append, failing the whole group and rebuilding the ledger from the log, once for every
declaration an attacker sent (an adversarial review, session 31; the sidecar's Hello bounds the
engine id the same way, coordinator/sidecar/protocol.py MAX_ENGINE_ID)."""
MAX_ENCODER_CACHE_TOKENS = 1 << 24
MAX_ENCODER_ENTRIES = 1 << 12
MAX_ENCODER_ENTRY_ID = 256
"""An engine's encoder cache: at most 16M tokens and 4,096 entries (vLLM's holds a multimodal
item's embeddings, hundreds to thousands of tokens each: tens of entries), entry ids of at most
256 characters. Unbounded (a cache of 2**62 tokens, one-token entries never freed), an engine grew
the state by ~1 MiB a step, and each allocation summed every entry on the event loop: 158-264 ms a
256-allocation step while other engines waited (an adversarial review, session 31)."""
MAX_JOBS_PER_ENGINE = 1 << 14
"""Jobs an engine may have in flight, fenced ones waiting for their ranks included. Jobs that were
never reported held state without end: 150 steps each loading one key 20,000 times kept 464 MiB,
and 204,800 one-key loads made every StoreExternal of any engine 20x slower and one ResetCache
fence them all in 1.4 s on the event loop (an adversarial review, session 31). vLLM has a few
jobs in flight a step, each ended within a step or two."""
MAX_ITEMS_PER_ENGINE = 1 << 20
"""Blocks or keys an engine's jobs in flight may move together (a job's items; ~150 B each in the
state): a job of one key named 20,000 times is 20,000 items."""
MAX_CLOCK_JUMP = float(1 << 28)
"""How far one step's clock (seconds) may leap past the engine's last (~8.5 years). The first
step of an incarnation may set any finite clock; every later one moves from it."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def stream_name(value: str, what: str) -> None:
    """An engine id or a tier name: it names a stream of the log, so it is 1..MAX_STREAM_NAME
    characters and holds no control character (PostgreSQL's text holds no NUL: an engine id
    "N\\x00" failed every append of its group; an adversarial review, session 31)."""
    if not value:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} is empty")
    if len(value) > MAX_STREAM_NAME:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} is {len(value):,} characters, at most {MAX_STREAM_NAME}")
    found = _CONTROL.search(value)
    if found is not None:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} holds the control character {found.group()!r}")


def room_for_a_job(state: State, eng: EngineState, items: int) -> None:
    """Refuses a new job of `items` blocks or keys of an engine that has MAX_JOBS_PER_ENGINE jobs
    in flight (fenced ones too), or would have more than MAX_ITEMS_PER_ENGINE items in them."""
    jobs, held = jobs_in_flight(state, eng.engine_id)
    if jobs >= MAX_JOBS_PER_ENGINE or held + items > MAX_ITEMS_PER_ENGINE:
        raise Refusal(
            Reason.TOO_MANY_JOBS,
            f"engine {eng.engine_id!r} has {jobs:,} jobs of {held:,} items in flight, at most {MAX_JOBS_PER_ENGINE:,} "
            f"of {MAX_ITEMS_PER_ENGINE:,} items (this one has {items:,}): they end as their ranks report (or fenced "
            "ranks are released)",
        )


class Refusal(Exception):
    """Raised inside the decider only; `decide` turns it into a Refused/NoticeDropped event."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def engine(state: State, engine_id: str) -> EngineState:
    found = state.engines.get(engine_id)
    if found is None:
        raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} was never declared")
    return found


def engine_in_step(state: State, engine_id: str) -> EngineState:
    found = engine(state, engine_id)
    if not found.step_open:
        raise Refusal(Reason.NO_OPEN_STEP, f"engine {engine_id!r} has no open step")
    return found


def pool(eng: EngineState, pool_id: int) -> PoolState:
    found = eng.pools.get(pool_id)
    if found is None:
        raise Refusal(Reason.UNKNOWN_POOL, f"engine {eng.engine_id!r} has no pool {pool_id}")
    return found


def tier(state: State, eng: EngineState, name: str) -> TierState:
    found = state.tiers.get(name)
    if found is None or name not in eng.tiers:
        raise Refusal(Reason.UNKNOWN_TIER, f"engine {eng.engine_id!r} has no tier {name!r}")
    return found


def owner(state: State, eng: EngineState, owner_id: int) -> OwnerState:
    found = state.owners.get(owner_id)
    if found is None or found.engine_id != eng.engine_id:
        raise Refusal(Reason.UNKNOWN_OWNER, f"engine {eng.engine_id!r} has no owner {owner_id}")
    return found


def block(eng: EngineState, ref: BlockRef, *, allow_null: bool = False) -> PoolState:
    """A reference to a real, current slot (I1, I2); returns its pool. `allow_null` exists only
    for the simulator's null-state-publication scenario (coordinator.core.protections)."""
    found = pool(eng, ref.pool_id)
    if ref.block_id == NULL_BLOCK_ID:
        if allow_null:
            return found
        raise Refusal(Reason.NULL_BLOCK, f"block 0 of pool {ref.pool_id} is the null block")
    if not 0 < ref.block_id < found.spec.num_blocks:
        raise Refusal(Reason.UNKNOWN_SLOT, f"pool {ref.pool_id} has no block {ref.block_id}")
    current = found.generations[ref.block_id]
    if ref.generation != current:
        raise Refusal(
            Reason.STALE_GENERATION,
            f"block {ref.pool_id}/{ref.block_id} is at generation {current}, not {ref.generation}",
        )
    return found


def count(value: int, limit: int, what: str) -> None:
    if not 0 < value <= limit:
        raise Refusal(Reason.INVALID_COUNT, f"{what} must be in 1..{limit}, got {value}")


def unique_refs(refs: list[BlockRef], what: str) -> None:
    count(len(refs), MAX_ITEMS_PER_COMMAND, f"number of {what}")
    if len(set(refs)) != len(refs):
        raise Refusal(Reason.INVALID_ARGUMENT, f"the same block appears twice among the {what}")


def finite(value: float, what: str, *, low: float = 0.0, high: float = math.inf) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} must be in [{low}, {high}], got {value}")
