"""The pure core: kvledger's rules, with no I/O (tests/core/test_purity.py checks every module here).

`decider.decide(state, command)` answers a command with events, `projector.apply(state, event)`
folds an event into the state, and `CoordinatorCore` runs the two together in memory (the
simulator, the tests and the benchmarks drive it; coordinator/ledger/ledger.py runs it on the log).
"""

from coordinator.core.in_memory import CoordinatorCore

__all__ = ["CoordinatorCore"]
