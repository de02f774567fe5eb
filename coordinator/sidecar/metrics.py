"""Prometheus metrics of one sidecar (prometheus_client, on a registry of its own).

Counters move as commits land; gauges that describe the state (pins, draining slots, published
keys) are read from the committed state when Prometheus scrapes, so they never drift from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.state import State
from events import Event, JobFailed, NoticeDropped, Reason, Refused

STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SidecarMetrics:
    def __init__(self, state: Callable[[], State]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "kvledger_step_seconds", "From a Step's arrival to its committed reply.", buckets=STEP_BUCKETS, registry=r
        )
        self.group_size = Histogram(
            "kvledger_commit_group_transactions", "Transactions committed together in one append (group commit).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )
        self.events_appended = Counter("kvledger_events_appended", "Events committed to the log.", registry=r)
        self.refusals = Counter(
            "kvledger_refusals", "Commands refused and notices dropped, by reason.", ["kind", "reason"], registry=r
        )
        self.lease_expiries = Counter("kvledger_lease_expiries", "Loads that completed after their lease expired (I12).", registry=r)
        self.append_errors = Counter("kvledger_log_append_errors", "Appends the log did not take.", registry=r)
        self.protocol_errors = Counter("kvledger_protocol_errors", "Error replies sent, by code.", ["code"], registry=r)
        self.connections = Gauge("kvledger_connections", "Open client connections.", registry=r)
        self.subscribers = Gauge("kvledger_subscribers", "Open decision subscriptions.", registry=r)
        self.slow_subscribers = Counter("kvledger_slow_subscribers_disconnected", "Subscriptions cut off for falling behind.", registry=r)
        self.ready = Gauge("kvledger_ready", "1 while the sidecar is ready (/readyz answers 200), else 0.", registry=r)
        r.register(_StateCollector(state))

    def committed(self, events: list[Event]) -> None:
        self.events_appended.inc(len(events))
        for event in events:
            if isinstance(event, Refused):
                self.refusals.labels("refused", event.reason.value).inc()
            elif isinstance(event, NoticeDropped):
                self.refusals.labels("dropped", event.reason.value).inc()
            elif isinstance(event, JobFailed) and event.reason == Reason.LEASE_EXPIRED:
                self.lease_expiries.inc()


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], State]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        pins = GaugeMetricFamily("kvledger_pins", "Pins held on device slots by jobs in flight (I3).", labels=["engine"])
        draining = GaugeMetricFamily("kvledger_draining_slots", "Slots with no owner left, still pinned by a job (I3).", labels=["engine"])
        for engine in state.engines.values():
            held = drained = 0
            for pool in engine.pools.values():
                held += sum(pool.pins)
                drained += sum(1 for refs, pinned in zip(pool.refs, pool.pins, strict=True) if pinned and not refs)
            pins.add_metric([engine.engine_id], held)
            draining.add_metric([engine.engine_id], drained)
        keys = GaugeMetricFamily("kvledger_published_keys", "Loadable keys, by tier.", labels=["tier"])
        for name, tier in state.tiers.items():
            keys.add_metric([name], sum(len(group) for group in tier.entries.values()))
        jobs = GaugeMetricFamily("kvledger_jobs_in_flight", "Jobs waiting for rank reports.")
        jobs.add_metric([], len(state.jobs))
        yield from (pins, draining, keys, jobs)
