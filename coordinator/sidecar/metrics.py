"""Prometheus metrics of one sidecar (prometheus_client, on a registry of its own).

Counters move as commits land (`SidecarMetrics.committed`, fed with each commit's events); gauges
that describe the state (pins, draining slots, published keys, the oldest pin's age) are read
from the committed state when Prometheus scrapes, so they never drift from it. The alerting
rules in ops/alerts/kvledger.rules.yml and the dashboard in ops/dashboards/ use these names, and
tests/ops/test_ops.py checks each name they use against a live sidecar's /metrics: rename one here
and that test fails until the rules follow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.core.state import JobState, State
from events import (
    Event,
    ExternalKeysLookedUp,
    JobFailed,
    KeyQuarantined,
    LoadJobStarted,
    NoticeDropped,
    Reason,
    Refused,
    StateCopyPlanned,
    StoreJobStarted,
)

STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

INTEGRITY_KINDS = ("checksum_mismatch", "store_conflict", "conflicting_report")
"""What `kvledger_integrity_violations_total{kind}` counts:

- checksum_mismatch: a load whose workers read other bytes than the key's published checksum
  (I13): the load failed and the key was quarantined; one per job.
- store_conflict: a key stored again with other bytes than the ones published (I10): someone
  computed wrong KV; the key was quarantined; one per key.
- conflicting_report: a rank reported the same job twice with different results (I4): a worker
  is confused about what it did.

Each is a refusal of something that would otherwise have served another request's KV, so each
one is worth a page. Every kind is exported from the start at 0, so `increase()` sees the first."""


class SidecarMetrics:
    def __init__(
        self, state: Callable[[], State], clock: Callable[[], float] = time.monotonic, *, engine_labels: bool = True
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "kvledger_step_seconds", "From a Step's arrival to its committed reply.", buckets=STEP_BUCKETS, registry=r
        )
        self.group_size = Histogram(
            "kvledger_commit_group_transactions",
            "Transactions committed together in one append (group commit).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.events_appended = Counter("kvledger_events_appended", "Events committed to the log.", registry=r)
        self.refusals = Counter(
            "kvledger_refusals", "Commands refused and notices dropped, by reason.", ["kind", "reason"], registry=r
        )
        self.lease_expiries = Counter(
            "kvledger_lease_expiries", "Loads that completed after their lease expired (I12).", registry=r
        )
        self.integrity_violations = Counter(
            "kvledger_integrity_violations",
            "KV whose bytes or reports contradict what was published, by kind: checksum_mismatch (a load, I13), "
            "store_conflict (a re-store with other bytes, I10), conflicting_report (a rank, I4).",
            ["kind"],
            registry=r,
        )
        for kind in INTEGRITY_KINDS:
            self.integrity_violations.labels(kind)
        self.append_errors = Counter("kvledger_log_append_errors", "Appends the log did not take.", registry=r)
        self.head_moved = Counter(
            "kvledger_log_head_moved",
            "Groups decided again because another writer (a sidecar on the same log) appended first.",
            registry=r,
        )
        self.caught_up_events = Counter(
            "kvledger_log_caught_up_events", "Events other writers appended, folded into this sidecar's state.", registry=r
        )
        self.protocol_errors = Counter("kvledger_protocol_errors", "Error replies sent, by code.", ["code"], registry=r)
        self.connections = Gauge("kvledger_connections", "Open client connections.", registry=r)
        self.subscribers = Gauge("kvledger_subscribers", "Open decision subscriptions.", registry=r)
        self.slow_subscribers = Counter(
            "kvledger_slow_subscribers_disconnected", "Subscriptions cut off for falling behind.", registry=r
        )
        self.lookups = Counter(
            "kvledger_lookup_keys",
            "Keys the sidecar's lookups answered, by answer (hit or miss), counted from their "
            "records in the log: hit / (hit + miss) is the tier's hit rate.",
            ["answer"],
            registry=r,
        )
        for answer in ("hit", "miss"):
            self.lookups.labels(answer)
        self.records_pending = Gauge(
            "kvledger_lookup_records_pending", "Records of answered lookups waiting for the log to take them.", registry=r
        )
        self.records_lost = Counter(
            "kvledger_lookup_records_lost",
            "Records of answered lookups dropped before the log took them (a long log "
            "outage, or the sidecar stopped during one): their answers are missing from the audit.",
            registry=r,
        )
        self.ready = Gauge("kvledger_ready", "1 while the sidecar is ready (/readyz answers 200), else 0.", registry=r)
        self.job_started: dict[int, float] = {}
        """job_id -> when this process saw its decision commit (`clock`): what pin ages count from."""
        r.register(_StateCollector(state, self.job_started, clock, engine_labels))
        self._state = state
        self._clock = clock

    def committed(self, events: list[Event]) -> None:
        self.events_appended.inc(len(events))
        # A load's checksum mismatch comes as KeyQuarantined(s) then JobFailed(CHECKSUM_MISMATCH)
        # for the same job, in the same commit (coordinator/core/jobs.py); a quarantine naming a job
        # with no such failure is a store's conflict (I10).
        counted = [event for event in events if type(event) in _COUNTED]  # most events count only in events_appended
        failed_loads = {e.job_id for e in counted if isinstance(e, JobFailed) and e.reason == Reason.CHECKSUM_MISMATCH}
        refusals: dict[tuple[str, str], int] = {}  # one labels() call per kind, not per event
        for event in counted:
            if isinstance(event, (Refused, NoticeDropped)):
                labels = ("refused" if isinstance(event, Refused) else "dropped", event.reason.value)
                refusals[labels] = refusals.get(labels, 0) + 1
                if event.reason == Reason.CONFLICTING_REPORT:  # a report is a notice: dropped, not refused
                    self.integrity_violations.labels("conflicting_report").inc()
            elif isinstance(event, JobFailed):
                if event.reason == Reason.LEASE_EXPIRED:
                    self.lease_expiries.inc()
                elif event.reason == Reason.CHECKSUM_MISMATCH:
                    self.integrity_violations.labels("checksum_mismatch").inc()
            elif isinstance(event, KeyQuarantined):
                if event.reason == Reason.CHECKSUM_MISMATCH and event.job_id not in failed_loads:
                    self.integrity_violations.labels("store_conflict").inc()
            elif isinstance(event, ExternalKeysLookedUp):
                hits = sum(event.loadable)
                self.lookups.labels("hit").inc(hits)
                self.lookups.labels("miss").inc(len(event.loadable) - hits)
            elif isinstance(event, (StoreJobStarted, LoadJobStarted, StateCopyPlanned)):
                self.job_started[event.job_id] = self._clock()
        for labels, count in refusals.items():
            self.refusals.labels(*labels).inc(count)
        if len(self.job_started) > 2 * _in_flight(self._state()) + 1024:
            # Nobody scrapes (the collector forgets finished jobs too): keep this bounded.
            _forget_finished(self.job_started, self._state())


_COUNTED: frozenset[type[Event]] = frozenset(
    {
        Refused,
        NoticeDropped,
        JobFailed,
        KeyQuarantined,
        ExternalKeysLookedUp,
        StoreJobStarted,
        LoadJobStarted,
        StateCopyPlanned,
    }
)
"""The event types `SidecarMetrics.committed` looks at beyond counting them (a set lookup per
event: a step's allocations and computations pass in one test, not six isinstance checks)."""


def _in_flight(state: State) -> int:
    return len(state.jobs) + len(state.fenced)


def _forget_finished(job_started: dict[int, float], state: State) -> None:
    for job_id in [job_id for job_id in job_started if job_id not in state.jobs and job_id not in state.fenced]:
        del job_started[job_id]  # a job id is never reused


def _pins(job: JobState) -> bool:
    """Whether the job holds pins on device slots (I3): every job but an unpinned store."""
    return not (isinstance(job.decision, StoreJobStarted) and not job.decision.pinned)


ALL_ENGINES = "all"
"""The engine label of every per-engine series when the sidecar runs with engine labels off."""


class _StateCollector(Collector):
    def __init__(
        self, state: Callable[[], State], job_started: dict[int, float], clock: Callable[[], float], engine_labels: bool = True
    ) -> None:
        self._state = state
        self._job_started = job_started
        self._clock = clock
        self._engine_labels = engine_labels

    def _engine(self, engine_id: str) -> str:
        """The engine label: its id, or "all" when engine labels are off (the series are summed)."""
        return engine_id if self._engine_labels else ALL_ENGINES

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        pins = GaugeMetricFamily("kvledger_pins", "Pins held on device slots by jobs in flight (I3).", labels=["engine"])
        draining = GaugeMetricFamily(
            "kvledger_draining_slots", "Slots with no owner left, still pinned by a job (I3).", labels=["engine"]
        )
        held: dict[str, int] = {}
        drained: dict[str, int] = {}
        for engine in state.engines.values():
            label = self._engine(engine.engine_id)
            for pool in engine.pools.values():
                held[label] = held.get(label, 0) + sum(pool.pins)
                drained[label] = drained.get(label, 0) + sum(
                    1 for refs, pinned in zip(pool.refs, pool.pins, strict=True) if pinned and not refs
                )
        for label in held.keys() | drained.keys():
            pins.add_metric([label], held.get(label, 0))
            draining.add_metric([label], drained.get(label, 0))
        keys = GaugeMetricFamily("kvledger_published_keys", "Loadable keys, by tier.", labels=["tier"])
        for name, tier in state.tiers.items():
            keys.add_metric([name], sum(len(group) for group in tier.published.values()))
        jobs = GaugeMetricFamily("kvledger_jobs_in_flight", "Jobs waiting for rank reports.")
        jobs.add_metric([], len(state.jobs))
        yield from (pins, draining, keys, jobs, self._oldest_pin(state))

    def _oldest_pin(self, state: State) -> Metric:
        """Per engine, the age of its oldest job in flight that pins slots, fenced ones included
        (they keep their pins until every rank is done, I16); 0 when it has none.

        The state records no wall time (time enters the core only as engine clocks, which stop
        when an engine hangs, just when a stuck pin matters), so the age counts from when this
        process saw the job's decision commit; a job recovered from the log at a restart counts
        from the first scrape after it: an age is never more than the truth."""
        now = self._clock()
        oldest = {self._engine(engine_id): 0.0 for engine_id in state.engines}
        in_flight = [*state.jobs.values(), *(fenced.job for fenced in state.fenced.values())]
        for job in in_flight:
            if not _pins(job):
                continue
            started = self._job_started.setdefault(job.job_id, now)
            label = self._engine(job.decision.engine_id)
            oldest[label] = max(oldest.get(label, 0.0), now - started)
        _forget_finished(self._job_started, state)
        gauge = GaugeMetricFamily(
            "kvledger_oldest_pin_seconds",
            "Age of the engine's oldest job in flight that pins device slots (I3), counted from its commit as this "
            "process saw it (or from the first scrape after a restart); 0 with none.",
            labels=["engine"],
        )
        for engine_id, age in oldest.items():
            gauge.add_metric([engine_id], age)
        return gauge
