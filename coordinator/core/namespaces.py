"""Namespace release decisions (seed 003): new, compatible or clear; and releasing an abandoned
namespace. Pure, like the rest of the decider.

Seed 003: "Choose one of three outcomes: a new namespace, verified compatible reuse, or
deliberate cache clearing", each a recorded release decision, and "assign expiration and cleanup
responsibility for old releases". Here:

- `new`: B shares nothing with A. Nothing changes; A's keys are never B's hits anyway, because
  the namespace roots every key's chain (I8, I9). The decision is the record.
- `compatible`: B may treat A's keys as equivalent. Refused without evidence (the id of a run
  that compared cached and uncached outputs), and refused across tenants (I9). It is recorded,
  not turned into an alias: B's lookups still hit only B's keys. An alias would have to chain
  every lookup twice (A's keys are rooted in A's id) on the lookup and load paths; until that
  exists the evidence and the decision are on the record for the next release, and nothing
  reads KV across a namespace boundary on kvledger's own say-so.
- `clear`: every key A has published is quarantined (NAMESPACE_CLEARED), so no lookup hits it and
  no load takes it; a load in flight fails when it completes (I13's KEY_QUARANTINED check).
- release: every key of the namespace is evicted, except that a key a live lease holds is never
  evicted (I12): the whole release is refused then, naming the loads.

An engine's reset that reaches the tier (`ended_by_reset`) ends its namespace's keys the same way.

Every decision relates two namespaces of one tenant: across tenants even a record would show one
tenant's namespace in the other's audit (I9).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast, get_args

from coordinator.core.checks import Refusal
from coordinator.core.commands import Command, DecideNamespace, ReleaseNamespace
from coordinator.core.state import KeyEntry, State
from coordinator.core.tier_slots import lease_live
from events import Event, KeyEvicted, KeyQuarantined, NamespaceDecided, NamespaceOutcome, NamespaceReleased, Reason

Handler = Callable[[State, Any], list[Event]]

OUTCOMES: tuple[str, ...] = get_args(NamespaceOutcome)
MAX_REASON_CHARS = 2000
MAX_EVIDENCE_CHARS = 255
"""An audit record, not a document: the evidence is a run id, the reason a sentence or two."""


def _namespace_id(state: State, text: str, what: str) -> bytes:
    """A registered namespace id from its hex text, or a refusal saying what is wrong with it."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    if not text.strip():
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} is empty: give a namespace id in hex")
    try:
        namespace = bytes.fromhex(text.strip())
    except ValueError:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} {shown!r} is not hex") from None
    if namespace not in state.namespaces:
        raise Refusal(Reason.UNKNOWN_NAMESPACE, f"{what} {shown} is not a registered namespace")
    return namespace


def _text(value: str, what: str, limit: int, *, required: bool) -> str:
    value = value.strip()
    if required and not value:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} is empty: a release decision says why")
    if len(value) > limit:
        raise Refusal(Reason.INVALID_ARGUMENT, f"{what} has {len(value)} characters, at most {limit}")
    return value


def _decide_namespace(state: State, command: DecideNamespace) -> list[Event]:
    if command.outcome not in OUTCOMES:
        raise Refusal(Reason.INVALID_ARGUMENT, f"outcome {command.outcome[:40]!r} is not one of {', '.join(OUTCOMES)}")
    source = _namespace_id(state, command.from_namespace, "--from namespace")
    target = _namespace_id(state, command.to_namespace, "--to namespace")
    if source == target:
        raise Refusal(Reason.INVALID_ARGUMENT, f"--from and --to are the same namespace {source.hex()}")
    rationale = _text(command.reason, "--reason", MAX_REASON_CHARS, required=True)
    evidence = _text(command.evidence, "--evidence", MAX_EVIDENCE_CHARS, required=False)
    source_tenant, target_tenant = state.namespaces[source].tenant, state.namespaces[target].tenant
    if source_tenant != target_tenant:
        # Shown to nobody but the operator: the refusal names neither tenant.
        raise Refusal(Reason.CROSS_TENANT, f"namespaces {source.hex()} and {target.hex()} belong to different tenants (I9)")
    if command.outcome == "compatible" and not evidence:
        raise Refusal(
            Reason.MISSING_EVIDENCE,
            "a compatible decision needs --evidence: the id of a verification run that compared cached and "
            "uncached outputs (seed 003)",
        )
    quarantines: list[Event] = []
    if command.outcome == "clear":
        detail = f"namespace {source.hex()} cleared by a release decision to {target.hex()}"
        quarantines = [
            KeyQuarantined(tier=tier, pool_id=pool_id, key=key, reason=Reason.NAMESPACE_CLEARED, job_id=0, detail=detail)
            for tier, pool_id, key, entry in _published(state, source)
            if not entry.quarantined
        ]
    decided = NamespaceDecided(
        from_namespace=source,
        to_namespace=target,
        outcome=cast(NamespaceOutcome, command.outcome),  # checked above
        rationale=rationale,
        evidence=evidence,
        affected_keys=len(quarantines),
    )
    return [decided, *quarantines]


def _release_namespace(state: State, command: ReleaseNamespace) -> list[Event]:
    namespace = _namespace_id(state, command.namespace, "namespace")
    rationale = _text(command.reason, "reason", MAX_REASON_CHARS, required=True)
    evictions: list[Event] = []
    held: dict[int, None] = {}
    for tier, pool_id, key, entry in _published(state, namespace):
        loads = _live_leases(state, entry)
        if loads:
            held.update(dict.fromkeys(loads))
            continue
        evictions.append(KeyEvicted(tier=tier, pool_id=pool_id, key=key, tier_slot=entry.tier_slot, engine_id=""))
    if held:
        raise Refusal(
            Reason.NAMESPACE_IN_USE,
            f"namespace {namespace.hex()} has keys under live leases of load jobs {sorted(held)} (I12): release it when they end",
        )
    return [NamespaceReleased(namespace_id=namespace, rationale=rationale, evicted_keys=len(evictions)), *evictions]


def _published(state: State, namespace: bytes) -> list[tuple[str, int, bytes, KeyEntry]]:
    """Every key `namespace` has in any tier: (tier, pool_id, key, entry), in a fixed order
    (tiers, groups and keys as the state holds them: the same log, the same events, I18)."""
    return [
        (name, pool_id, key, tier.entry_at(slot))
        for name, tier in state.tiers.items()
        for pool_id, group in tier.published.items()
        for key, slot in group.items()
        if tier.namespace_ids[slot] == namespace
    ]


def _live_leases(state: State, entry: KeyEntry) -> list[int]:
    """The load jobs whose lease on the key is still live on their engine's clock (I12: a lease
    is live while clock < expiry). A lease whose job or engine is unknown counts as live."""
    return [job_id for job_id, expiry in (entry.leases or {}).items() if lease_live(state, job_id, expiry)]


def ended_by_reset(state: State, engine_id: str, namespace: bytes, tiers: list[str]) -> list[Event]:
    """A reset that reaches the tier (ResetCache.drop_tier_keys): every key of `namespace` in
    `tiers` ends. A key no live lease holds is evicted (its slot comes free); one a load still
    holds is quarantined instead (I12: a leased key is never evicted), so that no lookup finds it
    and the load fails when it completes (KEY_QUARANTINED)."""
    ended: list[Event] = []
    for tier, pool_id, key, entry in _published(state, namespace):
        if tier not in tiers:
            continue
        loads = _live_leases(state, entry)
        if not loads:
            ended.append(KeyEvicted(tier=tier, pool_id=pool_id, key=key, tier_slot=entry.tier_slot, engine_id=engine_id))
        elif not entry.quarantined:
            detail = f"engine {engine_id!r} reset its cache and the tier's while load job(s) {loads} hold the key"
            ended.append(KeyQuarantined(tier=tier, pool_id=pool_id, key=key, reason=Reason.ENGINE_RESET, job_id=0, detail=detail))
    return ended


HANDLERS: dict[type[Command], Handler] = {
    DecideNamespace: _decide_namespace,
    ReleaseNamespace: _release_namespace,
}
