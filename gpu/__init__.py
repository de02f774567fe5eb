"""kvledger's hands: device pools, tiers, verified transfers, ordered state copies.

Empty until issue 5. Workers will act only on committed decisions (events.StoreJobStarted,
events.LoadJobStarted, events.StateCopyPlanned) and answer with coordinator.core.commands.ReportRank.
"""
